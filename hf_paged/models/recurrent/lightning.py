"""MiniMax's lightning attention (linear attention with a per-head constant decay) as a
``RecurrentMixer``.

Per head ``h`` with slope ``s_h``, the state ``S`` (``[D, D]``, keys by values) and a token's
``(q, k, v)``::

    S <- exp(-s_h) * S + k v^T
    o  = S^T q

which is what the HF module computes block by block (``block_size``) on a prompt and token by
token on a decode. ``q, k, v = silu(qkv_proj(x))`` per head, no scaling; the output is
``out_proj(sigmoid(output_gate(x)) * norm(o))``. The state is kept in the model's dtype, as the
HF cache keeps it; the math runs in fp32.

``linear_attention_chunked`` serves any per-token log decay ``g`` (the gated linear attention
family): chunks of all sequences batched as in ``delta_rule.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.models.recurrent.base import RecurrentMeta, RecurrentMixer, StateSpec
from hf_paged.models.recurrent.delta_rule import CHUNK, ChunkLayout

HF_CLASSES = ("MiniMaxLightningAttention",)


def linear_attention_step(
    q: torch.Tensor,  # [N, H, K] fp32
    k: torch.Tensor,  # [N, H, K]
    v: torch.Tensor,  # [N, H, V]
    g: torch.Tensor,  # [N, H] log decay
    state: torch.Tensor,  # [N, H, K, V] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # o [N, H, V], new state
    s = state * g.exp()[..., None, None] + k[..., None] * v[..., None, :]
    return (s * q[..., None]).sum(dim=-2), s


def linear_attention_chunked(
    q: torch.Tensor,  # [T, H, K] fp32
    k: torch.Tensor,  # [T, H, K]
    v: torch.Tensor,  # [T, H, V]
    g: torch.Tensor,  # [T, H] log decay
    state: torch.Tensor,  # [N, H, K, V] fp32
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, V], final states [N, H, K, V]
    c, m = layout.chunk, layout.num_chunks

    def chunked(x):  # [T, H, ...] -> [M, H, C, ...]; padded positions zero (g = 0: no decay)
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[layout.gather]
        return padded.view(m, c, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc = chunked(q), chunked(k), chunked(v), chunked(g)
    cum = gc.cumsum(dim=-1)  # [M, H, C]
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    intra = ((qc @ kc.transpose(-1, -2)) * decay) @ vc  # [M, H, C, V]
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    out = torch.empty_like(vc)
    s_all = state.clone()
    for j, seqs in enumerate(layout.seqs):
        lo, hi = layout.starts[j], layout.starts[j + 1]
        s = s_all.index_select(0, seqs)
        out[lo:hi] = q_dec[lo:hi] @ s + intra[lo:hi]
        s = s * chunk_decay[lo:hi] + k_dec[lo:hi].transpose(-1, -2) @ vc[lo:hi]
        s_all.index_copy_(0, seqs, s)
    flat = out.transpose(1, 2).reshape(m * c, out.shape[1], out.shape[-1])
    return flat[layout.scatter], s_all


class LightningAttentionMixer(RecurrentMixer):
    """One HF ``MiniMaxLightningAttention`` on the engine's flattened step."""

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        m = hf_module
        for name in ("qkv_proj", "output_gate", "out_proj", "norm", "act_fn"):
            if not hasattr(m, name):
                raise ValueError(f"{type(m).__name__} has no {name}: not a lightning attention")
        self.hf = m
        self.heads, self.head_dim = m.num_attention_heads, m.head_dim
        # log decay per head: -slope (the module's own formula, not a loaded buffer)
        dev = m.qkv_proj.weight.device  # on it once: no host copy in a captured decode step
        self._log_decay = -m.get_slope_rate(device=dev).flatten().float()  # [H]

    @classmethod
    def from_hf(cls, hf_module: nn.Module) -> LightningAttentionMixer:
        return cls(hf_module)

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.qkv_proj.weight.dtype
        return [StateSpec("kv", (self.heads, self.head_dim, self.head_dim), dtype)]

    def hf_result(self, out: torch.Tensor):
        return out, None  # (attn_output, attn_weights_inter) as the HF forward

    def forward(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["kv"] [S+1, H, Dh, Dh]``."""
        m, t, h, d = self.hf, hidden.shape[0], self.heads, self.head_dim
        qkv = m.act_fn(m.qkv_proj(hidden)).reshape(t, h, 3 * d).float()
        q, k, v = torch.split(qkv, d, dim=-1)  # [T, H, D] each
        g = self._log_decay.expand(t, h)
        pool, idx, has = states["kv"], meta.state_indices, meta.has_initial_state
        s0 = pool.index_select(0, idx).float()
        s0 = torch.where(has[:, None, None, None], s0, torch.zeros_like(s0))
        if meta.num_prefills == 0:
            o, s1 = linear_attention_step(q, k, v, g, s0)
        else:
            layout = ChunkLayout(meta.seq_lens, CHUNK, hidden.device)
            o, s1 = linear_attention_chunked(q, k, v, g, s0, layout)
        pool.index_copy_(0, idx, s1.to(pool.dtype))
        o = m.norm(o.to(hidden.dtype).reshape(t, h * d))
        return m.out_proj(F.sigmoid(m.output_gate(hidden)) * o)
