"""RMSNorm with an optional fused residual add, numerically identical to HF's LlamaRMSNorm.

On CUDA (with triton) each call is one Triton launch (``hf_paged.kernels.fused_norm``); elsewhere
it runs the torch references, which are HF's ops one for one.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_paged.kernels import fused_norm
from hf_paged.kernels.fused_norm import fused_add_rms_norm_ref, rms_norm_ref
from hf_paged.layers.linear import check_shape, read_shard


class RMSNorm(nn.Module):
    """``weight * normalize(x)`` over the last dim, statistics in float32.

    Called as ``norm(x)`` it returns the normalized ``x``. Called as ``norm(x, residual)`` it first
    forms ``h = x + residual`` (in the input dtype, as HF's decoder layers do) and returns
    ``(norm(h), h)``: the new residual stream is ``h``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        check_shape(loaded, param.shape)
        param.data.copy_(read_shard(loaded))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        fused = fused_norm.supports(x, self.weight, residual)
        if residual is None:
            if fused:
                return fused_norm.rms_norm(x, self.weight, self.eps)
            return rms_norm_ref(x, self.weight, self.eps)
        if fused:
            return fused_norm.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_ref(x, residual, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
