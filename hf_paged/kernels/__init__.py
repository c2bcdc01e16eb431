"""Triton kernels, each with a torch reference beside it.

``HF_PAGED_FUSED=0`` turns the fused elementwise kernels (norm, rope, activation) off, so the
layers run their torch reference code on CUDA too (for A/B measurements and bisecting)."""

import os

_FUSED = os.environ.get("HF_PAGED_FUSED", "1") != "0"  # read once, at import


def fused_enabled() -> bool:
    return _FUSED
