"""An activation already quantized to FP8 by the layer that produced it.

RMSNorm before q/k/v and gate/up, and SiLU-and-mul before down, can write their output straight
as float8 values with per-token-group scales (``kernels/fp8/fp8_fused_quant.py``) when the next layer
is an FP8 linear with dynamic activations (block-scaled: groups of ``weight_block_size[1]``;
row-wise, compressed-tensors: RMSNorm only, one scale per token): one kernel instead of a norm
and a quantization pass. They hand
the FP8 linear this object in place of a tensor; ``fp8_linear`` multiplies it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.kernels.fp8.fp8_quant import dequantize_activation_ref


@dataclass(frozen=True)
class Fp8Activation:
    """Attributes:
    q: ``[T, K]`` float8_e4m3fn values.
    scale: ``[T, ceil(K / group)]`` fp32, column-major (strides ``(1, T)``, cuBLASLt's layout).
    group: columns per scale (the consumer's ``weight_block_size[1]``; >= K: one per token).
    dtype: the dtype the producer would have returned (the GEMM's output dtype).
    """

    q: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def device(self) -> torch.device:
        return self.q.device

    def dequantize(self) -> torch.Tensor:  # [T, K] in ``dtype``
        """``q * scale`` (what the producer's output was, up to FP8 rounding)."""
        return dequantize_activation_ref(self.q, self.scale, self.group).to(self.dtype)
