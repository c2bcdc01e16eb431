"""Recurrent HF layers on the generic path: each runs as its ``RecurrentMixer``.

After the weights are loaded, every HF layer the recurrent registry knows gets its mixer
(``models/recurrent/registry.py``) and its ``forward`` is rebound to run that mixer on the
step's flattened rows, so the HF decoder layer around it (norms, residuals, MLP) runs as
written. The mixers are numbered in module order: mixer ``i`` reads and writes
``AttentionMetadata.recurrent_states[i]``, the pool tensors the runner built from
``state_specs``. During the profile pass (no engine step) each call gets zeroed scratch states,
one slot per profile sequence, so the flattening check sees the mixers keep sequences apart.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from hf_paged.attention.base import AttentionMetadata
from hf_paged.models.generic.attention import current_state
from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.models.recurrent import registry
from hf_paged.models.recurrent.base import RecurrentMeta, RecurrentMixer, StateSpec
from hf_paged.models.recurrent.state_pool import StatePool
from hf_paged.refusal import Refusal


def recurrent_refusal(model: nn.Module, tp_size: int) -> Refusal | None:
    """Why the engine cannot serve ``model``'s recurrent layers, or None (also None when it
    has none)."""
    found = registry.recurrent_modules(model)
    if not found:
        return None
    name = type(model).__name__
    missing = registry.unserved({type(m).__name__ for _, m in found})
    if missing:
        return Refusal("architecture", f"{name} has recurrent layers no mixer serves yet "
                       f"(hybrid/recurrent): {', '.join(missing)}")  # fmt: skip
    if tp_size > 1:
        return Refusal("tensor_parallel_size", f"{name}: tensor_parallel_size={tp_size} is not "
                       f"allowed: recurrent layers ({type(found[0][1]).__name__}) are not "
                       "sharded; allowed: 1")  # fmt: skip
    return None


class RecurrentLayers:
    """The mixers of one generic model and the per-forward ``RecurrentMeta``."""

    def __init__(self, model: nn.Module):
        self.mixers: list[RecurrentMixer] = []
        for name, module in registry.recurrent_modules(model):
            cls = registry.mixer_class(type(module).__name__)
            if cls is None:
                raise UnsupportedModelError(f"{name}: {type(module).__name__} has no mixer")
            try:
                mixer = cls.from_hf(module)
            except ValueError as e:
                raise UnsupportedModelError(f"{name}: {e}") from e
            self.mixers.append(mixer)
            _rebind(module, self, len(self.mixers) - 1)
        self.meta: RecurrentMeta | None = None  # the running step's, while a forward runs

    def __len__(self) -> int:
        return len(self.mixers)

    def state_specs(self) -> list[list[StateSpec]]:
        """Per mixer, the states one sequence needs."""
        return [m.state_specs() for m in self.mixers]

    def begin(self, meta: AttentionMetadata) -> None:
        """Build the step's ``RecurrentMeta`` from the attention metadata (once per forward)."""
        if meta.recurrent_states is None or meta.state_indices is None:
            raise RuntimeError("the step carries no recurrent states (state_indices / pool)")
        cu = meta.cu_seqlens_q_cpu
        lens = [b - a for a, b in zip(cu, cu[1:])] if cu is not None else [1] * meta.num_seqs
        self.meta = RecurrentMeta(
            cu_seqlens=meta.cu_seqlens_q,
            state_indices=meta.state_indices,
            has_initial_state=meta.has_initial_state,
            num_prefills=0 if meta.is_decode else sum(1 for n in lens if n > 1),
            seq_lens=lens,
        )

    def end(self) -> None:
        self.meta = None

    def run(self, i: int, hidden: torch.Tensor) -> torch.Tensor:  # [1, T, D] -> [1, T, D]
        st = current_state()
        if st is None:
            raise RuntimeError("a recurrent layer of an hf_paged model ran outside an engine step")
        if st.recorder is not None:  # the profile pass: fresh zero states per call
            meta, states = _scratch(self.mixers[i], st.recorder.segments)
        else:
            meta, states = self.meta, st.meta.recurrent_states[i]
        return self.mixers[i](hidden[0], meta, states)[None]


def _rebind(module: nn.Module, layers: RecurrentLayers, i: int) -> None:
    """``module.forward`` runs mixer ``i`` on its hidden states (positional or by name)."""

    def forward(mod, *args, **kwargs):
        hidden = args[0] if args else kwargs.get("hidden_states", kwargs.get("input_states"))
        return layers.mixers[i].hf_result(layers.run(i, hidden))

    module.forward = types.MethodType(forward, module)


def _scratch(mixer: RecurrentMixer, segments: torch.Tensor):
    """Zero states and a ``RecurrentMeta`` for the profile row (``segments [T]``: which
    sequence each token belongs to, sequences contiguous)."""
    _, counts = torch.unique_consecutive(segments, return_counts=True)
    lens = counts.tolist()
    dev = segments.device
    pool = StatePool([mixer.state_specs()], num_slots=len(lens), device=dev)
    slots = [pool.alloc() for _ in lens]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    meta = RecurrentMeta(
        cu_seqlens=cu.to(dev),
        state_indices=torch.tensor(slots, dtype=torch.long, device=dev),
        has_initial_state=torch.zeros(len(lens), dtype=torch.bool, device=dev),
        num_prefills=sum(1 for n in lens if n > 1),
        seq_lens=lens,
    )
    return meta, pool.layers[0]
