"""The coverage run on one GPU (marker gpu, skipped without CUDA): every architecture the CPU
coverage test serves gives stock's tokens on CUDA too (fp32, the Triton backend, decode CUDA
graphs where the probe allows them); none fails.

The run over ~150 architectures takes over 8 minutes in one process, so it is split into
``CUDA_SHARDS`` tests of every ``CUDA_SHARDS``-th architecture. Their engines have fixed KV sizes
(no share of the device), so GPU part 7 (``tests/gpu_parts.py``) runs them side by side with
pytest-xdist where it is installed.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models.coverage_models import causal_lm_entries, markdown_table, run_all, summary

CUDA_SHARDS = 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shard", range(CUDA_SHARDS))
def test_coverage_cuda_parity(shard):
    """Every served architecture gives stock's tokens on CUDA too; none fails (one shard of
    the architectures: every ``CUDA_SHARDS``-th, from ``shard``)."""
    types = [mt for mt, _ in causal_lm_entries()][shard::CUDA_SHARDS]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_all(types, device="cuda")
    print("\n" + markdown_table(results))
    failed = [(r.model_type, r.detail) for r in results if r.status == "failure"]
    assert failed == []
    assert summary(results)["served"] > 0
