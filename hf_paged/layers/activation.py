"""Gated activations applied to a fused [gate | up] projection.

On CUDA (with triton) one Triton launch (``hf_paged.kernels.fused_act``); elsewhere torch's ops.
Before a block-scaled FP8 linear (``quant_group`` set by the model) the CUDA launch writes FP8
with per-token-group scales instead (``kernels/fp8/fp8_fused_quant.py``) and returns an
``Fp8Activation``; everywhere else the tensor, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.kernels import fused_act
from hf_paged.kernels.fp8 import fp8_fused_quant
from hf_paged.layers.quantization.fp8_activation import Fp8Activation
from hf_paged.layers.quantization.fp8_linear import quantizes_activations


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dim: [T, 2I] -> [T, I].

    Args:
        quant_group: the consumer is a block-scaled FP8 linear quantizing its input in groups of
            this many columns; the output may then be an ``Fp8Activation``.
    """

    def __init__(self, quant_group: int | None = None):
        super().__init__()
        self.quant_group = quant_group

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Activation:
        group = self.quant_group
        if (
            group is not None
            and fp8_fused_quant.act_supports(x, group)
            and quantizes_activations(x.device)
        ):
            q, s = fp8_fused_quant.silu_and_mul_quant(x, group)
            return Fp8Activation(q, s, group, x.dtype)
        if fused_act.supports(x):
            return fused_act.silu_and_mul(x)
        return fused_act.silu_and_mul_ref(x)
