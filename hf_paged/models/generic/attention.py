"""The attention function hf_paged registers with transformers' ``AttentionInterface``.

An HF attention module calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module,
query, key, value, attention_mask, scaling=..., **kwargs)`` with ``[1, H, T, D]`` tensors (the
batch is flattened to one row of T tokens). During an engine step this function writes the new
K/V into the paged cache and runs the engine's attention backend over it, returning
``[1, T, H, Dv]``; during the profile pass it records the call instead (``profile.py``).

Which step is running is scoped per forward (``StepState.active``, refusing nesting) and read
from a context variable, so the function needs nothing from ``**kwargs`` (some models do not
forward them to attention) and two engines in one process never see each other's state.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from hf_paged.attention.base import AttentionMetadata
from hf_paged.layers.attention import Attention
from hf_paged.models.generic.sinks import sink_attention

ATTN_IMPL = "hf_paged"  # the name registered with transformers' AttentionInterface
BINDING_ATTR = "_hf_paged_layer"  # attribute set on each HF attention module after profiling

_ACTIVE: contextvars.ContextVar[StepState | None] = contextvars.ContextVar(
    "hf_paged_generic_step", default=None
)


@dataclass(frozen=True)
class LayerBinding:
    """What one HF attention module runs at a step: per attention call of a forward (usually
    one), hf_paged's paged attention layer for that call's KV layer (``attn.layer_idx``, which
    picks the backend that can compute its spec) and whether it has attention sinks."""

    attns: tuple[Attention, ...]
    sinks: tuple[bool, ...]


class StepState:
    """One generic model's per-forward state: the step's metadata, or a profile recorder."""

    def __init__(self):
        self.meta: AttentionMetadata | None = None
        self.recorder = None  # profile.Recorder while the profile pass runs
        self.calls: dict[int, int] = {}  # id(module) -> attention calls so far this forward

    @contextmanager
    def active(self, meta: AttentionMetadata | None = None, recorder=None) -> Iterator[None]:
        """Make this state the one the attention function reads, for one forward."""
        if _ACTIVE.get() is not None:
            raise RuntimeError("a generic model forward is already running in this context")
        self.meta, self.recorder = meta, recorder
        self.calls = {}
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            self.meta = self.recorder = None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [1, H, T, D]
    key: torch.Tensor,  # [1, Hkv, T, D]
    value: torch.Tensor,  # [1, Hkv, T, Dv]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:  # [1, T, H, Dv]
    state = _ACTIVE.get()
    if state is None:
        raise RuntimeError(
            f"attn_implementation={ATTN_IMPL!r} runs only inside an hf_paged engine step; "
            "load the model with another attn_implementation to call it directly"
        )
    if state.recorder is not None:
        return state.recorder.record(module, query, key, value, attention_mask, scaling, dropout,
                                     kwargs)  # fmt: skip
    binding: LayerBinding | None = module.__dict__.get(BINDING_ATTR)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} was not seen by the profile pass")
    q = query[0].transpose(0, 1).contiguous()  # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()  # [T, Hkv, D]
    v = value[0].transpose(0, 1).contiguous()  # [T, Hkv, Dv]
    call = state.calls.get(id(module), 0)
    state.calls[id(module)] = call + 1
    attn = binding.attns[call]
    if binding.sinks[call]:
        out = sink_attention(q, k, v, kwargs["s_aux"], state.meta, attn.layer_idx, attn.spec,
                             attn.backend)  # fmt: skip
    else:
        out = attn(q, k, v, state.meta)  # [T, H * Dv]; the HF module applied rope
    return out.view(1, q.shape[0], q.shape[1], -1), None


def register() -> None:
    """Register ``paged_attention_forward`` as ``ATTN_IMPL`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
