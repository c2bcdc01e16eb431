"""``StatePool``: the per-sequence states of every recurrent layer, beside the paged KV cache.

One tensor per (layer, state name), ``[num_slots + 1, *spec.shape]``. Slot 0 is a dummy that
padded rows of a CUDA graph read and write; a sequence gets one of the slots ``1..num_slots``
when it is admitted and keeps it until it finishes, is aborted or preempted (preemption
recomputes, so the state is dropped). ``alloc`` zeroes the slot; ``fork`` copies one (beam search,
``n > 1``). The pool itself is torch-only bookkeeping: the scheduler owns which sequence has
which slot.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged.models.recurrent.base import StateSpec


def bytes_per_slot(layer_specs: Sequence[Sequence[StateSpec]]) -> int:
    """Bytes one sequence's states take over all layers (``layer_specs[i]``: layer i's)."""
    total = 0
    for specs in layer_specs:
        for s in specs:
            n = 1
            for d in s.shape:
                n *= d
            total += n * torch.empty((), dtype=s.dtype).element_size()
    return total


class StatePool:
    """The recurrent states of ``num_slots`` sequences.

    Args:
        layer_specs: per recurrent layer (in the order the mixers are numbered), its states.
        num_slots: sequences that can hold a state at once (the engine's ``max_num_seqs``).
        device: where the tensors live.

    Raises:
        ValueError: ``num_slots`` < 1 or two specs of one layer share a name.
    """

    def __init__(self, layer_specs: Sequence[Sequence[StateSpec]], num_slots: int, device):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots} must be >= 1")
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.layer_specs = [list(specs) for specs in layer_specs]
        self.layers: list[dict[str, torch.Tensor]] = []  # layer -> name -> [num_slots + 1, ...]
        for i, specs in enumerate(self.layer_specs):
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise ValueError(f"layer {i}: state names {names} must be distinct")
            self.layers.append({
                s.name: torch.zeros((num_slots + 1, *s.shape), dtype=s.dtype, device=self.device)
                for s in specs
            })  # fmt: skip
        self._free = list(range(num_slots, 0, -1))  # pop() hands out the lowest slot first
        self._used: set[int] = set()

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot takes over all layers."""
        return bytes_per_slot(self.layer_specs)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free slot (>= 1), its states zeroed.

        Raises:
            RuntimeError: no slot is free (the scheduler admits only with a free slot).
        """
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        for states in self.layers:
            for t in states.values():
                t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back.

        Raises:
            ValueError: ``slot`` is not in use.
        """
        if slot not in self._used:
            raise ValueError(f"slot={slot} is not in use (allowed: {sorted(self._used)})")
        self._used.remove(slot)
        self._free.append(slot)

    def fork(self, src: int) -> int:
        """A new slot holding a copy of ``src``'s states (a beam or a sample forking).

        Raises:
            ValueError: ``src`` is not in use. RuntimeError: no slot is free.
        """
        if src not in self._used:
            raise ValueError(f"src={src} is not in use (allowed: {sorted(self._used)})")
        dst = self.alloc()
        self.copy(src, dst)
        return dst

    def copy(self, src: int, dst: int) -> None:
        """Copy every state of slot ``src`` into slot ``dst`` (both in use)."""
        for states in self.layers:
            for t in states.values():
                t[dst].copy_(t[src])

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Forks' states (``(src, dst)`` slot pairs), every source read before any destination
        is written."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        for states in self.layers:
            for t in states.values():
                t[dst] = t[src]

    def gather(self, slots: list[int]) -> list[dict[str, torch.Tensor]]:
        """The states at ``slots``: ``{name: [len(slots), *shape]}`` per layer, in order."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        return [{name: t.index_select(0, index) for name, t in layer.items()}
                for layer in self.layers]  # fmt: skip

    def reset(self) -> None:
        """Free every slot (the engine's caches are dropped)."""
        self._free = list(range(self.num_slots, 0, -1))
        self._used.clear()
