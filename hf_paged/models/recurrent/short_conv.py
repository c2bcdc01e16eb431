"""LFM2's gated short convolution (LFM2, LFM3) as a ``RecurrentMixer``.

As the HF module (``Lfm2ShortConv``; ``Lfm3ShortConv`` is the same code):
``B, C, x = in_proj(h)`` (in that order along the features), a depthwise causal convolution of
``B * x`` without activation (its window of ``conv_L_cache - 1`` inputs carried in the ``conv``
state, model dtype), ``C * conv`` and ``out_proj``. There is no recurrent state: the window is
all a sequence carries.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.models.recurrent.base import RecurrentMeta, StateSpec
from hf_paged.models.recurrent.conv_window import causal_conv
from hf_paged.models.recurrent.padded import PaddedLayout, PaddedMixer

# the HF classes this mixer serves
HF_CLASSES = ("Lfm2ShortConv", "Lfm3ShortConv")


class ShortConvMixer(PaddedMixer):
    """One HF ``Lfm2ShortConv`` on the engine's flattened step (its parameters, shared).

    Args:
        hf_module: the HF layer (``conv``, ``in_proj``, ``out_proj``).
    """

    def __init__(self, hf_module: nn.Module):
        super().__init__()
        for name in ("conv", "in_proj", "out_proj"):
            if not hasattr(hf_module, name):
                raise ValueError(
                    f"{type(hf_module).__name__} has no {name!r}: not an LFM2 short convolution "
                    f"(allowed: {', '.join(HF_CLASSES)})"
                )
        self.hf = hf_module
        self.hidden_size = hf_module.conv.weight.shape[0]
        self.kernel = hf_module.conv.weight.shape[-1]

    @classmethod
    def from_hf(cls, hf_module: nn.Module, config=None) -> ShortConvMixer:
        return cls(hf_module)

    def state_specs(self) -> list[StateSpec]:
        dtype = self.hf.in_proj.weight.dtype
        return [StateSpec("conv", (self.hidden_size, self.kernel - 1), dtype)]

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states["conv"] [S+1, D, K-1]``."""
        m = self.hf
        b, c, x = m.in_proj(hidden).chunk(3, dim=-1)  # 3 x [T, D]
        layout = PaddedLayout.build(meta, hidden.shape[0])
        bx = layout.pack(b * x)  # [N, L, D]
        conv = causal_conv(bx, m.conv.weight[:, 0, :], m.conv.bias, states["conv"], meta, layout)
        return m.out_proj(c * layout.unpack(conv))
