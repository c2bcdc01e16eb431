"""Mamba 1 (Mamba, Falcon-Mamba, Jamba's Mamba layers) as a ``RecurrentMixer``.

As the HF mixer: ``x, z = in_proj(h)``; a depthwise causal conv of ``x`` with the activation
(its ``kernel - 1`` window carried in the ``conv`` state, model dtype); ``dt, B, C = x_proj(x)``
(Falcon-Mamba and Jamba RMS-norm each of them there with the module's own norms: weightless
in Falcon-Mamba, weighted in Jamba); ``dt = softplus(dt_proj.weight @ dt + dt_proj.bias)``; the
selective scan ``h = exp(dt * A) * h + (dt * B) * x``, ``y = h . C + D * x`` over a fp32
``recurrent`` state ``[d_inner, d_state]`` (as stock keeps it); ``y * silu(z)``; ``out_proj``.

The scan walks the step's longest chunk position by position over all its sequences at once
(``padded.py``; ``dt = 0`` past a chunk's end leaves the state as it is): exact, and one step
for a decode-only batch; on CUDA one Triton program per (sequence, channel block) does the walk
with its state in registers (``kernels/recurrent_scan.py``, beside its torch reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.kernels.recurrent_scan import selective_scan
from hf_paged.models.recurrent.base import RecurrentMeta, StateSpec
from hf_paged.models.recurrent.conv_window import causal_conv
from hf_paged.models.recurrent.padded import PaddedLayout, PaddedMixer, initial_states

# the HF classes this mixer serves
HF_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")


class MambaMixer(PaddedMixer):
    """One HF Mamba 1 mixer on the engine's flattened step (its parameters, shared).

    Args:
        hf_module: the HF layer (any class of ``HF_CLASSES`` or one with the same fields).
    """

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        for name in ("in_proj", "conv1d", "x_proj", "dt_proj", "A_log", "D", "out_proj"):
            if not hasattr(hf_module, name):
                raise ValueError(
                    f"{type(hf_module).__name__} has no {name!r}: not a Mamba 1 mixer "
                    f"(allowed: {', '.join(HF_CLASSES)})"
                )
        self.hf = m = hf_module
        self.d_inner, self.d_state = m.A_log.shape
        self.kernel = m.conv1d.weight.shape[-1]
        self.dt_rank = m.dt_proj.weight.shape[1]
        # Falcon-Mamba / Jamba: RMS norms on dt, B and C after x_proj
        self.bcdt_norms = hasattr(m, "b_layernorm")

    @classmethod
    def from_hf(cls, hf_module: nn.Module, config=None) -> MambaMixer:
        return cls(hf_module)

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.in_proj.weight.dtype
        return [
            StateSpec("conv", (self.d_inner, self.kernel - 1), dtype),
            StateSpec("recurrent", (self.d_inner, self.d_state), torch.float32),
        ]

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["conv"] [S+1, E, K-1]``,
        ``states["recurrent"] [S+1, E, N]`` fp32, updated at ``meta.state_indices``."""
        m = self.hf
        layout = PaddedLayout.build(meta, hidden.shape[0])
        x, z = layout.pack(m.in_proj(hidden)).chunk(2, dim=-1)  # 2 x [N, L, E]
        weight = m.conv1d.weight[:, 0, :]
        x = causal_conv(x, weight, m.conv1d.bias, states["conv"], meta, layout, m.act)
        dt, b, c = torch.split(m.x_proj(x), [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.bcdt_norms:
            dt, b, c = m.dt_layernorm(dt), m.b_layernorm(b), m.c_layernorm(c)
        dt = F.softplus(torch.matmul(dt, m.dt_proj.weight.T).float() + m.dt_proj.bias.float())
        dt = dt * layout.valid[..., None]  # [N, L, E]: the state holds past a chunk's end
        a = -torch.exp(m.A_log.float())  # [E, S]
        h0 = initial_states(states["recurrent"], meta)
        y, h = selective_scan(x, dt, a, b, c, h0)
        states["recurrent"].index_copy_(0, meta.state_indices, h)
        y = (y + x.float() * m.D.float()) * F.silu(z.float())  # [N, L, E]
        return m.out_proj(layout.unpack(y).to(hidden.dtype))
