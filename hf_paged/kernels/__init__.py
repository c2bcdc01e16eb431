"""Triton kernels, each with a torch reference beside it.

Which kernels the layers dispatch to is switched in ``hf_paged/envs.py``: ``HF_PAGED_FUSED``
(norm, rope, activation), ``HF_PAGED_SKINNY_GEMM``, ``HF_PAGED_ARGMAX``, ``HF_PAGED_TOKEN_SCORES``
(prompt logprobs) and ``HF_PAGED_PDL``."""

from hf_paged import envs


def fused_enabled() -> bool:
    """Whether the fused elementwise kernels (norm, rope, activation) may run
    (``HF_PAGED_FUSED``)."""
    return envs.HF_PAGED_FUSED
