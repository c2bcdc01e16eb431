"""Which sequence holds which slot of the recurrent state pool. No torch.

A model with recurrent layers (``models/recurrent``) keeps each sequence's state in one slot of
the runner's ``StatePool`` (slots ``1..num_slots``; 0 is the dummy that padded CUDA-graph rows
use). The ``BlockManager`` hands a slot out with a sequence's first blocks and takes it back
with its last ones, so a slot is held exactly while KV blocks are: from admission to finish,
abort, preemption or parking (the state is dropped with the KV and recomputed).
"""

from __future__ import annotations


class StateSlots:
    """Free list of ``num_slots`` state slots (ids ``1..num_slots``).

    Raises:
        ValueError: ``num_slots`` < 1.
    """

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots={num_slots!r} is not allowed: must be >= 1")
        self.num_slots = num_slots
        self._free = list(range(num_slots, 0, -1))  # pop() hands out the lowest first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        """A free slot id (>= 1). Raises RuntimeError when none is free."""
        if not self._free:
            raise RuntimeError(f"no free state slot (all {self.num_slots} in use)")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        """Give ``slot`` back. Raises ValueError when it is not in use."""
        if slot not in self._used:
            raise ValueError(f"slot={slot!r} is not in use")
        self._used.remove(slot)
        self._free.append(slot)
