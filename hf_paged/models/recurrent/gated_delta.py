"""Gated DeltaNet (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, LaraMini, OLMo-hybrid) as a
``RecurrentMixer``.

The HF module's own parameters run it (shared, not copied). The families differ only in how the
hidden rows become ``(qkv, z, b, a)``:

* Qwen3-Next: ``in_proj_qkvz`` and ``in_proj_ba``, interleaved per key-head group (the module's
  own ``fix_query_key_value_ordering`` undoes it);
* Qwen3.5 / Qwen3.5-MoE / LaraMini: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``;
* OLMo-hybrid: ``q_proj``, ``k_proj``, ``v_proj``, ``g_proj`` (the gate), ``a_proj``,
  ``b_proj``; ``beta`` doubled when ``allow_neg_eigval``; ``o_norm`` / ``o_proj``.

Then, as the HF module: a depthwise causal conv over ``qkv`` with SiLU (its window of
``kernel - 1`` inputs carried in the ``conv`` state, model dtype), l2-normalized ``q``/``k``,
``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the gated delta rule over a
fp32 ``recurrent`` state ``[Hv, Dk, Dv]`` (``delta_rule.py``), the gated RMSNorm with ``z`` and
the output projection.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.models.recurrent.base import RecurrentMeta, RecurrentMixer, StateSpec
from hf_paged.models.recurrent.conv_state import conv_step, conv_varlen
from hf_paged.models.recurrent.delta_rule import (
    CHUNK,
    ChunkLayout,
    delta_rule_chunked,
    delta_rule_step,
    l2norm,
)

# the HF classes this mixer serves (``registry.py`` maps them here)
HF_CLASSES = (
    "Qwen3NextGatedDeltaNet",
    "Qwen3_5GatedDeltaNet",
    "Qwen3_5MoeGatedDeltaNet",
    "LaraMiniGatedDeltaNet",
    "OlmoHybridGatedDeltaNet",
)


def _layout_of(module: nn.Module) -> str:
    if hasattr(module, "in_proj_qkvz"):
        return "qkvz"
    if hasattr(module, "in_proj_qkv"):
        return "qkv"
    if all(hasattr(module, n) for n in ("q_proj", "k_proj", "v_proj", "g_proj")):
        return "separate"
    raise ValueError(
        f"{type(module).__name__}: no Gated DeltaNet projection layout recognized (allowed: "
        "in_proj_qkvz + in_proj_ba, in_proj_qkv + in_proj_z/b/a, q/k/v/g/a/b_proj)"
    )


class GatedDeltaNetMixer(RecurrentMixer):
    """One HF Gated DeltaNet module on the engine's flattened step.

    Args:
        hf_module: the HF layer (any class of ``HF_CLASSES`` or one with the same fields).
    """

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        self.layout = _layout_of(hf_module)
        self.hf = hf_module
        m = hf_module
        self.num_k_heads, self.num_v_heads = m.num_k_heads, m.num_v_heads
        self.head_k_dim, self.head_v_dim = m.head_k_dim, m.head_v_dim
        self.key_dim, self.value_dim = m.key_dim, m.value_dim
        self.conv_dim = m.conv_dim
        self.kernel = m.conv_kernel_size
        if m.activation not in ("silu", "swish"):
            raise ValueError(f"{type(m).__name__}.activation={m.activation!r}: allowed silu/swish")
        self.beta_scale = 2.0 if getattr(m, "allow_neg_eigval", False) else 1.0
        self.norm = m.o_norm if self.layout == "separate" else m.norm
        self.out_proj = m.o_proj if self.layout == "separate" else m.out_proj

    @classmethod
    def from_hf(cls, hf_module: nn.Module) -> GatedDeltaNetMixer:
        return cls(hf_module)

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.conv1d.weight.dtype
        return [
            StateSpec("conv", (self.conv_dim, self.kernel - 1), dtype),
            StateSpec("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                      torch.float32),
        ]  # fmt: skip

    def _project(self, x: torch.Tensor):
        """``x [T, D]`` -> qkv [T, conv_dim], z [T, value_dim], b [T, Hv], a [T, Hv]."""
        m, t = self.hf, x.shape[0]
        if self.layout == "qkvz":
            q, k, v, z, b, a = m.fix_query_key_value_ordering(m.in_proj_qkvz(x[None]),
                                                              m.in_proj_ba(x[None]))  # fmt: skip
            qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
            return qkv, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)
        if self.layout == "qkv":
            return m.in_proj_qkv(x), m.in_proj_z(x), m.in_proj_b(x), m.in_proj_a(x)
        qkv = torch.cat([m.q_proj(x), m.k_proj(x), m.v_proj(x)], dim=-1)
        return qkv, m.g_proj(x), m.b_proj(x), m.a_proj(x)

    def forward(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["conv"] [S+1, C, K-1]``,
        ``states["recurrent"] [S+1, Hv, Dk, Dv]`` fp32, updated at ``meta.state_indices``."""
        m, t = self.hf, hidden.shape[0]
        qkv, z, b, a = self._project(hidden)
        weight = m.conv1d.weight[:, 0, :]  # [C, K]
        idx, has = meta.state_indices, meta.has_initial_state
        decode = meta.num_prefills == 0 and all(n == 1 for n in meta.seq_lens)
        if decode:
            qkv = conv_step(qkv, weight, m.conv1d.bias, states["conv"], idx, has)
        else:
            qkv = conv_varlen(qkv, weight, m.conv1d.bias, states["conv"], idx, has, meta.seq_lens)
        qkv = F.silu(qkv)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        rep = self.num_v_heads // self.num_k_heads
        q = q.reshape(t, self.num_k_heads, self.head_k_dim).float()
        k = k.reshape(t, self.num_k_heads, self.head_k_dim).float()
        if rep > 1:  # each q/k head serves `rep` consecutive v heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
        q = l2norm(q) * self.head_k_dim**-0.5
        k = l2norm(k)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim).float()
        beta = b.sigmoid().float() * self.beta_scale  # [T, Hv]
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)  # [T, Hv]
        pool = states["recurrent"]
        s0 = pool.index_select(0, idx)
        s0 = torch.where(has[:, None, None, None], s0, torch.zeros_like(s0))
        if decode:
            o, s1 = delta_rule_step(q, k, v, g, beta, s0)
        else:
            layout = ChunkLayout(meta.seq_lens, CHUNK, hidden.device)
            o, s1 = delta_rule_chunked(q, k, v, g, beta, s0, layout)
        pool.index_copy_(0, idx, s1)
        o = o.to(hidden.dtype).reshape(t * self.num_v_heads, self.head_v_dim)
        o = self.norm(o, z.reshape(t * self.num_v_heads, self.head_v_dim))
        return self.out_proj(o.reshape(t, self.value_dim))
