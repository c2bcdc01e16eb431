"""RMSNorm with an optional fused residual add, numerically identical to HF's LlamaRMSNorm.

On CUDA (with triton) each call is one Triton launch (``hf_paged.kernels.fused_norm``); elsewhere
it runs the torch references, which are HF's ops one for one.

Before a block-scaled FP8 linear (``quant_group`` set by the model) the norm on CUDA writes its
output as FP8 with per-token-group scales in the same launch (``kernels/fp8/fp8_fused_quant.py``) and
returns an ``Fp8Activation`` that the FP8 layer multiplies as it is. Everywhere else (plain
layers, CPU, ``HF_PAGED_FP8_GEMM=dequant|w8a8_ref``) it returns the tensor as before.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_paged.kernels import fused_norm
from hf_paged.kernels.fp8 import fp8_fused_quant
from hf_paged.kernels.fused_norm import fused_add_rms_norm_ref, rms_norm_ref
from hf_paged.layers.linear import check_shape, read_shard
from hf_paged.layers.quantization.fp8_activation import Fp8Activation
from hf_paged.layers.quantization.fp8_linear import quantizes_activations


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` over the last dim, statistics in float32.

    Called as ``norm(x)`` it returns the normalized ``x``. Called as ``norm(x, residual)`` it first
    forms ``h = x + residual`` (in the input dtype, as HF's decoder layers do) and returns
    ``(norm(h), h)``: the new residual stream is ``h``.

    Args:
        quant_group: the consumer is a block-scaled FP8 linear quantizing its input in groups of
            this many columns; the output may then be an ``Fp8Activation`` (module docstring).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, quant_group: int | None = None):
        super().__init__()
        self.eps = eps
        self.quant_group = quant_group
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        check_shape(loaded, param.shape)
        param.data.copy_(read_shard(loaded))

    def _quantized(self, x: torch.Tensor, residual: torch.Tensor | None):
        group = self.quant_group
        q, s, new_res = fp8_fused_quant.rms_norm_quant(x, residual, self.weight, self.eps, group)
        act = Fp8Activation(q, s, group, x.dtype)
        return act if residual is None else (act, new_res)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | Fp8Activation | tuple[torch.Tensor | Fp8Activation, torch.Tensor]:
        if (
            self.quant_group is not None
            and fp8_fused_quant.norm_supports(x, self.weight, residual, self.quant_group)
            and quantizes_activations(x.device)
        ):
            return self._quantized(x, residual)
        fused = fused_norm.supports(x, self.weight, residual)
        if residual is None:
            if fused:
                return fused_norm.rms_norm(x, self.weight, self.eps)
            return rms_norm_ref(x, self.weight, self.eps)
        if fused:
            return fused_norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        q = "" if self.quant_group is None else f", quant_group={self.quant_group}"
        return f"{self.weight.shape[0]}, eps={self.eps}{q}"
