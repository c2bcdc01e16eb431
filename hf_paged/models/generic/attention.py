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
from hf_paged.layers.attention import Attention, RopeInputs
from hf_paged.layers.rotary import apply_rotary_emb_qk
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
        # deferred rope (``rope.py``): enabled after the profile pass found it safe; the last
        # rope call's tensors until the attention call that consumes them; profile counters
        self.defer_rope = False
        self.pending_rope = None
        self.rope_calls = 0
        self.rope_mismatch = False

    @contextmanager
    def active(self, meta: AttentionMetadata | None = None, recorder=None) -> Iterator[None]:
        """Make this state the one the attention function reads, for one forward."""
        if _ACTIVE.get() is not None:
            raise RuntimeError("a generic model forward is already running in this context")
        self.meta, self.recorder = meta, recorder
        self.calls = {}
        self.pending_rope = None
        token = _ACTIVE.set(self)
        try:
            yield
        finally:
            _ACTIVE.reset(token)
            # a profiled rope call whose outputs reached no attention call: not deferrable
            self.rope_mismatch |= recorder is not None and not _consumed(self.pending_rope)
            self.meta = self.recorder = self.pending_rope = None


def _consumed(pending) -> bool:
    return pending is None or pending.consumed


def current_state() -> StepState | None:
    """The generic model forward running in this context, if any."""
    return _ACTIVE.get()


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
    # the last rope call's outputs stay pending until the next one: a module may attend with
    # them more than once (DiffLlama), each call rotating for its own KV layer
    pending = state.pending_rope
    consumes = pending is not None and query is pending.q and key is pending.k
    if state.recorder is not None:
        state.rope_mismatch |= pending is not None and not consumes
        if consumes:
            pending.consumed = True
        return state.recorder.record(module, query, key, value, attention_mask, scaling, dropout,
                                     kwargs)  # fmt: skip
    binding: LayerBinding | None = module.__dict__.get(BINDING_ATTR)
    if binding is None:
        raise RuntimeError(f"{type(module).__name__} was not seen by the profile pass")
    if pending is not None and not consumes:
        raise RuntimeError(
            f"{type(module).__name__}: the query/key reaching attention are not the deferred "
            "rope's (the profile pass saw them passed straight through)"
        )
    rope = RopeInputs(pending.cos, pending.sin) if consumes else None
    q = query[0].transpose(0, 1)  # [T, H, D] (strided: the rotary kernel reads it as it is)
    k = key[0].transpose(0, 1)  # [T, Hkv, D]
    if rope is None:
        q, k = q.contiguous(), k.contiguous()
    v = value[0].transpose(0, 1).contiguous()  # [T, Hkv, Dv]
    call = state.calls.get(id(module), 0)
    state.calls[id(module)] = call + 1
    attn = binding.attns[call]
    if binding.sinks[call]:
        if rope is not None:
            q, k, _ = apply_rotary_emb_qk(q, k, rope.cos, rope.sin)
        out = sink_attention(q, k, v, kwargs["s_aux"], state.meta, attn.layer_idx, attn.spec,
                             attn.backend)  # fmt: skip
    else:
        out = attn(q, k, v, state.meta, rope=rope)  # [T, H * Dv]
    return out.view(1, q.shape[0], q.shape[1], -1), None


def register() -> None:
    """Register ``paged_attention_forward`` as ``ATTN_IMPL`` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPL, paged_attention_forward)
