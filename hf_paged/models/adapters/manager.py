"""``LoraManager``: one engine's adapters, on the runner's side.

Two tiers, as vLLM's ``LoRAModelManager``: a host-side cache of registered adapters (at most
``max_cpu_loras``, least recently used evicted first; an adapter from a live PEFT model holds that
model's own tensors, one from disk its loaded ones) and ``max_loras`` device slots in every wrapped
layer. ``prepare`` gives each of a step's tokens the slot of its sequence's adapter, loading an
adapter into a free or least recently used slot that this step does not need; the scheduler
never runs more distinct adapters at once than there are slots. On CUDA a decode step's slots
are one device tensor (one token per sequence), read by the per-token kernels, which a decode
graph replays; other steps are grouped by slot on the host (segments) or, when every token
shares one adapter, need nothing more than that slot.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from hf_paged.kernels.lora_per_token import available as per_token_available
from hf_paged.kernels.lora_segmented import LoraSegments
from hf_paged.models.adapters.adapter import LoraAdapter
from hf_paged.models.adapters.layers import TARGETS, attach_lora


@dataclass(frozen=True)
class LoraSpec:
    """What the runner builds for LoRA (picklable; in ``RuntimeInfo`` and ``RunnerSpec``)."""

    max_loras: int  # device slots
    max_rank: int  # slot rank: adapters of higher rank are refused
    max_cpu_loras: int  # registered adapters kept on the host
    dtype: str | None = None  # the slots' dtype ("float32" ...); None: the model's
    from_peft: bool = False  # the engine serves an in-memory PEFT model's base weights unmerged


_UNIFORM = LoraSegments.from_slots([], "cpu")  # a step's segments when one slot serves all


class LoraManager:
    """The adapters of one runner's model (module docstring)."""

    def __init__(self, model, spec: LoraSpec, device, dtype: torch.dtype, hf_prefix: str = ""):
        self.spec = spec
        self.device = torch.device(device)
        slot_dtype = getattr(torch, spec.dtype) if spec.dtype else dtype
        self.step, self.slices, self.layers = attach_lora(
            model, hf_prefix, spec.max_loras, spec.max_rank, slot_dtype, self.device
        )
        self.adapters: OrderedDict[str, LoraAdapter] = OrderedDict()  # key -> adapter, LRU
        # decode steps through the per-token kernels (CUDA with triton): what lets decode
        # graphs capture the LoRA ops (``engine/worker/cuda_graph.py``)
        self.per_token = per_token_available(self.device)
        self._decode_host: list[int] | None = None  # the last decode step's slots
        self._decode_dev: torch.Tensor | None = None  # ... on the device
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # key -> device slot, LRU

    # ---- registration --------------------------------------------------------------------

    def add(self, adapter: LoraAdapter) -> str:
        """Register ``adapter`` (validated against the wrapped layers); returns its key.

        Raises:
            ValueError: rank above the slot rank, a module the engine does not wrap, or factor
                shapes of another base model; the message names the adapter. Nothing changes.
        """
        key = adapter.key
        if key in self.adapters:
            self.adapters.move_to_end(key)
            return key
        self.check(adapter)
        self.adapters[key] = adapter
        while len(self.adapters) > self.spec.max_cpu_loras:
            old = next(k for k in self.adapters)
            self.remove_key(old)
        return key

    def check(self, adapter: LoraAdapter) -> None:
        """The ValueError ``add`` raises for an adapter this engine cannot serve, or nothing."""
        name = adapter.name
        if adapter.rank > self.spec.max_rank:
            raise ValueError(
                f"LoRA adapter {name!r} has rank {adapter.rank}, above the engine's slot rank "
                f"max_lora_rank={self.spec.max_rank}; raise max_lora_rank to at least "
                f"{adapter.rank}"
            )
        unknown = sorted(m for m in adapter.layers if m not in self.slices)
        if unknown:
            raise ValueError(
                f"LoRA adapter {name!r} targets modules the engine does not wrap: {unknown[:4]}; "
                f"LoRA is served on the decoder's {', '.join(TARGETS)} projections"
            )
        for module, f in adapter.layers.items():
            s = self.slices[module]
            if f.a.shape[1] != s.in_size or f.b.shape[0] != s.size or f.b.shape[1] != f.rank:
                raise ValueError(
                    f"LoRA adapter {name!r} does not fit this base model: {module!r} has "
                    f"lora_A {tuple(f.a.shape)} and lora_B {tuple(f.b.shape)}, the model's layer "
                    f"takes [{f.rank}, {s.in_size}] and [{s.size}, {f.rank}] (an adapter trained "
                    "on another base model?)"
                )

    def remove_name(self, name: str) -> None:
        """Forget every registered version of adapter ``name``."""
        for key in [k for k, a in self.adapters.items() if a.name == name]:
            self.remove_key(key)

    def remove_key(self, key: str) -> None:
        self.adapters.pop(key, None)
        self.slot_of.pop(key, None)  # its slot is free (rewritten before reuse)

    def has(self, key: str) -> bool:
        return key in self.adapters

    # ---- per step ------------------------------------------------------------------------

    def prepare(self, chunks) -> None:
        """Set the step's token slots from its chunks' ``lora_key`` (None: no adapter).

        Raises:
            RuntimeError: more distinct adapters than slots, or an adapter no longer registered
                (the scheduler and the front ends keep both from happening).
        """
        self.finish()  # nothing of the last step's stays
        keys = {c.lora_key for c in chunks if c.lora_key is not None}
        if not keys:
            return
        if len(keys) > self.spec.max_loras:
            raise RuntimeError(f"a step needs {len(keys)} LoRA adapters, above max_loras="
                               f"{self.spec.max_loras}")  # fmt: skip
        slot = {k: self._slot(k, keys) for k in keys}
        if self.per_token and all(len(c.token_ids) == 1 for c in chunks):  # a decode step
            slots = [slot[c.lora_key] if c.lora_key is not None else -1 for c in chunks]
            if slots != self._decode_host:  # decode steps repeat their slots: one copy
                self._decode_host = slots
                self._decode_dev = torch.tensor(slots, dtype=torch.int32).to(self.device)
            self.step.decode_slots = self._decode_dev
            return
        if len(keys) == 1 and all(c.lora_key is not None for c in chunks):
            # one adapter for every token: the layers need nothing else (``LayerLora._uniform``)
            self.step.uniform_slot = slot[next(iter(keys))]
            self.step.segments, self.step.token_slots = _UNIFORM, None
            return
        token_slots: list[int] = []
        for c in chunks:
            s = slot[c.lora_key] if c.lora_key is not None else -1
            token_slots.extend([s] * len(c.token_ids))
        uniform = token_slots[0] if len(set(token_slots)) == 1 else None
        self.step.uniform_slot = uniform if uniform is not None and uniform >= 0 else None
        self.step.segments = LoraSegments.from_slots(token_slots, self.device)
        zero = self.spec.max_loras  # the slot that stays zero: tokens without an adapter
        self.step.token_slots = torch.tensor([s if s >= 0 else zero for s in token_slots],
                                             dtype=torch.int64).to(self.device)  # fmt: skip

    def finish(self) -> None:
        self.step.segments, self.step.uniform_slot, self.step.token_slots = None, None, None
        self.step.decode_slots = None

    def _slot(self, key: str, needed: set[str]) -> int:
        """``key``'s device slot, loading it into a free or least recently used one."""
        if key in self.slot_of:
            self.slot_of.move_to_end(key)
            return self.slot_of[key]
        adapter = self.adapters.get(key)
        if adapter is None:
            raise RuntimeError(f"LoRA adapter {key!r} is not registered (evicted?)")
        used = set(self.slot_of.values())
        free = [s for s in range(self.spec.max_loras) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next(k for k in self.slot_of if k not in needed)
            slot = self.slot_of.pop(victim)
        with torch.no_grad():
            for layer in self.layers:
                layer.write(slot, adapter.layers)
        self.slot_of[key] = slot
        return slot
