"""Mamba 2 (Mamba2, Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1) as a ``RecurrentMixer``.

As the HF mixer: ``gate, xBC, dt = in_proj(h)`` (Falcon-H1 first scales ``h`` by
``ssm_in_multiplier`` and the projection by its ``mup_vector``); a depthwise causal conv of
``xBC`` with the activation (its ``kernel - 1`` window carried in the ``conv`` state, model
dtype); ``x, B, C`` split with ``n_groups`` groups of ``B``/``C``;
``dt = softplus(dt + dt_bias)``; the SSD recurrence (``ssd.py``) over a
fp32 ``recurrent`` state ``[heads, head_dim, d_state]``; ``+ D * x``; the module's own gated
RMSNorm (grouped by ``n_groups``; Falcon-H1's norm-before-gate variant, or a plain
``silu(gate)`` where ``mamba_rms_norm`` is off); ``out_proj``.

Prefill and mixed steps run the chunked SSD over the padded step (``padded.py``; ``dt = 0``
past a chunk's end leaves the state as it is); a step of single tokens runs ``ssd_step``.
Stock clamps ``dt`` to ``time_step_limit`` in the call that runs the prompt and not in its
single-token decode calls (nor does the decode kernel), so a token's ``dt`` depends on whether
stock saw it as prompt or decode: a limit other than the default ``(0, inf)`` (a no-op after
softplus) is refused by name, and the model runs stock.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.models.recurrent.base import RecurrentMeta, StateSpec
from hf_paged.models.recurrent.conv_window import causal_conv
from hf_paged.models.recurrent.padded import PaddedLayout, PaddedMixer, initial_states
from hf_paged.models.recurrent.ssd import ssd_chunked, ssd_step

_INF = float("inf")
# the HF classes this mixer serves
HF_CLASSES = (
    "Mamba2Mixer",
    "BambaMixer",
    "GraniteMoeHybridMambaLayer",
    "NemotronHMamba2Mixer",
    "FalconH1Mixer",
)
_FIELDS = ("in_proj", "conv1d", "dt_bias", "A_log", "D", "norm", "out_proj", "num_heads",
           "head_dim", "n_groups", "ssm_state_size", "intermediate_size", "conv_dim",
           "chunk_size")  # fmt: skip


class Mamba2Mixer(PaddedMixer):
    """One HF Mamba 2 mixer on the engine's flattened step (its parameters, shared).

    Args:
        hf_module: the HF layer (any class of ``HF_CLASSES`` or one with the same fields).
    """

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        for name in _FIELDS:
            if not hasattr(hf_module, name):
                raise ValueError(
                    f"{type(hf_module).__name__} has no {name!r}: not a Mamba 2 mixer "
                    f"(allowed: {', '.join(HF_CLASSES)})"
                )
        self.hf = m = hf_module
        self.heads, self.head_dim, self.groups = m.num_heads, m.head_dim, m.n_groups
        self.d_state, self.d_inner, self.conv_dim = (
            m.ssm_state_size,
            m.intermediate_size,
            m.conv_dim,
        )
        self.kernel = m.conv1d.weight.shape[-1]
        self.chunk = m.chunk_size
        limit = tuple(float(v) for v in getattr(m, "time_step_limit", None) or (0.0, _INF))
        if limit != (0.0, _INF):
            raise ValueError(
                f"time_step_limit={limit} is not allowed: stock clamps dt to it in the prompt's "
                "forward but not in its decode steps; allowed: (0.0, inf)"
            )
        # Falcon-H1: muP multipliers around in_proj; its gated norm is optional
        self.in_multiplier = getattr(m, "ssm_in_multiplier", None)
        self.gated_norm = getattr(m, "mamba_rms_norm", True)

    @classmethod
    def from_hf(cls, hf_module: nn.Module, config=None) -> Mamba2Mixer:
        return cls(hf_module)

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.in_proj.weight.dtype
        return [
            StateSpec("conv", (self.conv_dim, self.kernel - 1), dtype),
            StateSpec("recurrent", (self.heads, self.head_dim, self.d_state), torch.float32),
        ]

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        m = self.hf
        if self.in_multiplier is not None:
            hidden = hidden * self.in_multiplier
        p = m.in_proj(hidden)  # [T, I + conv_dim + H]
        mup = getattr(m, "mup_vector", None)
        return p if mup is None else p * mup.reshape(-1)

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["conv"] [S+1, conv_dim, K-1]``,
        ``states["recurrent"] [S+1, H, P, N]`` fp32, updated at ``meta.state_indices``."""
        m, heads, p, g, s = self.hf, self.heads, self.head_dim, self.groups, self.d_state
        layout = PaddedLayout.build(meta, hidden.shape[0])
        gate, xbc, dt = self._project(hidden).split([self.d_inner, self.conv_dim, heads], dim=-1)
        weight = m.conv1d.weight[:, 0, :]
        xbc = causal_conv(
            layout.pack(xbc), weight, m.conv1d.bias, states["conv"], meta, layout, m.act
        )
        x, b, c = xbc.split([self.d_inner, g * s, g * s], dim=-1)  # [N, L, *]
        n, length = layout.valid.shape
        x = x.reshape(n, length, heads, p)
        b, c = b.reshape(n, length, g, s), c.reshape(n, length, g, s)
        dt = F.softplus(layout.pack(dt).float() + m.dt_bias.float())
        dt = dt * layout.valid[..., None]  # [N, L, H]: the state holds past a chunk's end
        a = -torch.exp(m.A_log.float())  # [H]
        h0 = initial_states(states["recurrent"], meta)
        if length == 1:
            y, h = ssd_step(x[:, 0], dt[:, 0], a, b[:, 0], c[:, 0], h0)
            y = y[:, None]
        else:
            y, h = ssd_chunked(x, dt, a, b, c, h0, self.chunk)
        states["recurrent"].index_copy_(0, meta.state_indices, h)
        y = y + m.D.float()[:, None] * x.float()  # [N, L, H, P]
        y = layout.unpack(y.reshape(n, length, self.d_inner))  # [T, I] fp32
        y = m.norm(y, gate) if self.gated_norm else y * F.silu(gate)
        return m.out_proj(y.to(hidden.dtype))
