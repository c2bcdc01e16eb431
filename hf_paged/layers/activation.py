"""Gated activations applied to a fused [gate | up] projection.

On CUDA (with triton) one Triton launch (``hf_paged.kernels.fused_act``); elsewhere torch's ops.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.kernels import fused_act


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where ``x = [gate | up]`` along the last dim: [T, 2I] -> [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_act.supports(x):
            return fused_act.silu_and_mul(x)
        return fused_act.silu_and_mul_ref(x)
