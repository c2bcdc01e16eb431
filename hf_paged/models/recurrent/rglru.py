"""RecurrentGemma's recurrent block (Griffin/Hawk: conv1d + RG-LRU) as a ``RecurrentMixer``.

As the HF block (``RecurrentGemmaRecurrentBlock``): ``y = act(linear_y(h))``;
``x = linear_x(h)`` through a depthwise causal conv with bias and no activation (its window of
``conv1d_width - 1`` inputs carried in the ``conv`` state, model dtype); the RG-LRU on ``x``:
per head block-diagonal gates ``i = sigmoid(x W_i + b_i)``, ``r = sigmoid(x W_r + b_r)``,
``log a = -8 r softplus(recurrent_param)``, ``state = a * state + sqrt(1 - a^2) * (i * x)``
over a fp32 ``recurrent`` state ``[lru_width]`` (``kernels/recurrent_scan.py``: a Triton walk on
CUDA, its torch reference elsewhere); ``linear_out(state * y)``.

At a sequence's first token (position 0) stock resets: ``a = 0`` and no ``sqrt(1 - a^2)``
factor. The engine has no padding, so position 0 is the first row of a chunk without
``has_initial_state``. (In a left-padded HF batch, ``generate``'s position ids put the reset at
each row's first real token, but the conv window still sees the padding's inputs.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.kernels.recurrent_scan import linear_scan
from hf_paged.models.recurrent.base import RecurrentMeta, StateSpec
from hf_paged.models.recurrent.conv_window import causal_conv
from hf_paged.models.recurrent.padded import PaddedLayout, PaddedMixer, initial_states

# the HF classes this mixer serves
HF_CLASSES = ("RecurrentGemmaRecurrentBlock",)


class RGLRUMixer(PaddedMixer):
    """One HF RecurrentGemma recurrent block on the engine's flattened step (its parameters,
    shared).

    Args:
        hf_module: the HF block (``linear_x``, ``linear_y``, ``linear_out``, ``conv_1d``,
            ``rg_lru``).
    """

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        for name in ("linear_x", "linear_y", "linear_out", "conv_1d", "rg_lru", "act_fn"):
            if not hasattr(hf_module, name):
                raise ValueError(
                    f"{type(hf_module).__name__} has no {name!r}: not an RG-LRU block "
                    f"(allowed: {', '.join(HF_CLASSES)})"
                )
        self.hf = hf_module
        self.width = hf_module.conv_1d.weight.shape[0]
        self.kernel = hf_module.conv_1d.weight.shape[-1]
        self.heads = hf_module.rg_lru.num_attention_heads

    @classmethod
    def from_hf(cls, hf_module: nn.Module, config=None) -> RGLRUMixer:
        return cls(hf_module)

    def hf_result(self, out: torch.Tensor):
        """What the HF block's forward returns for the mixer's output: ``(out, None)``."""
        return out, None

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.linear_x.weight.dtype
        return [
            StateSpec("conv", (self.width, self.kernel - 1), dtype),
            StateSpec("recurrent", (self.width,), torch.float32),
        ]

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [N, L, W]`` -> (input gate, recurrent gate): per head ``x_h @ W_h + b_h``."""
        lru = self.hf.rg_lru
        xh = x.reshape(-1, self.heads, self.width // self.heads).transpose(0, 1)  # [H, NL, bw]
        gate_i = torch.baddbmm(lru.input_gate_bias[:, None, :], xh, lru.input_gate_weight)
        gate_r = torch.baddbmm(lru.recurrent_gate_bias[:, None, :], xh, lru.recurrent_gate_weight)
        return (torch.sigmoid(g.transpose(0, 1).reshape(x.shape)) for g in (gate_i, gate_r))

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["conv"] [S+1, W, K-1]``,
        ``states["recurrent"] [S+1, W]`` fp32, updated at ``meta.state_indices``."""
        m, lru = self.hf, self.hf.rg_lru
        layout = PaddedLayout.build(meta, hidden.shape[0])
        y = m.act_fn(m.linear_y(hidden))  # [T, W]
        x = layout.pack(m.linear_x(hidden))  # [N, L, W]
        x = causal_conv(x, m.conv_1d.weight[:, 0, :], m.conv_1d.bias, states["conv"], meta, layout)
        gate_i, gate_r = self._gates(x)
        log_a = -8.0 * gate_r * F.softplus(lru.recurrent_param)
        a, a_square = torch.exp(log_a), torch.exp(2 * log_a)
        # position 0 of a sequence: a = 0 and no normalization
        reset = torch.zeros_like(layout.valid)
        reset[:, 0] = ~meta.has_initial_state
        reset = reset[..., None]  # [N, L, 1]
        scale = torch.where(reset, torch.ones_like(a_square), torch.sqrt(1 - a_square))
        u = x * gate_i * scale.to(x.dtype)
        valid = layout.valid[..., None]
        a = torch.where(valid & ~reset, a, (~valid).to(a.dtype))  # 0 at a reset
        u = u * valid  # past a chunk's end: a = 1, u = 0, the state holds
        h0 = initial_states(states["recurrent"], meta)
        out, h = linear_scan(a, u, h0)
        states["recurrent"].index_copy_(0, meta.state_indices, h)
        return m.linear_out(layout.unpack(out).to(hidden.dtype) * y)
