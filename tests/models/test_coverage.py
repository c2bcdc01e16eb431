"""Acceptance: every decoder-only text architecture in transformers' causal-LM mapping, built
tiny, is served by ``generate(backend="paged")`` with stock's greedy tokens, or falls back with
a named reason; none fails. Prints the table (``tests/models/coverage_models.py`` writes it).

The coverage run on one GPU (marker gpu, skipped without CUDA): every architecture the CPU
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

from tests.models.coverage_models import causal_lm_entries, markdown_table, run_all
from tests.models.coverage_report import run_and_print, summary

# ---- on any device --------------------------------------------------------------------------------


# share of the architectures that build tiny which must be served: 119 of 140 = 85% measured
# 2026-12-01 on transformers 5.24; 123 of 146 = 84% on 2026-12-02, when the hybrid and recurrent
# families first built tiny with their own fields (Gated DeltaNet and lightning attention served,
# the Mamba / short-conv / RG-LRU families falling back until their mixers land)
MIN_SERVED_PCT = 84


# popular architectures (the list) that must be served where transformers has them
MUST_SERVE = {
    "gemma", "gemma2", "gemma3_text", "phi", "phi3", "gpt2", "gpt_neox", "olmo2", "granite",
    "starcoder2", "cohere", "smollm3", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe",
    "deepseek_v3", "gpt_oss", "llama", "mistral", "qwen2", "qwen3", "falcon",
}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_and_print(run_all, markdown_table, tmp_path_factory.mktemp("coverage"))


def test_no_failures(results):
    failed = [(r.model_type, r.detail) for r in results if r.status == "failure"]
    assert failed == []


def test_served_share(results):
    counts = summary(results)
    assert counts["built"] > 0
    assert counts["served_pct"] >= MIN_SERVED_PCT, counts


def test_popular_architectures_served(results):
    present = {mt for mt, _ in causal_lm_entries()}
    status = {r.model_type: (r.status, r.detail) for r in results}
    missed = {mt: status[mt] for mt in MUST_SERVE & present if status[mt][0] != "served"}
    assert missed == {}


def test_hybrid_families_build_tiny(results):
    """Issue 32: every hybrid / recurrent family builds with its own fields (none "no_build")."""
    from hf_paged.testing.hybrid_configs import HYBRID_FAMILIES

    present = {mt for mt, _ in causal_lm_entries()}
    status = {r.model_type: (r.status, r.detail) for r in results}
    assert {mt: status[mt] for mt in set(HYBRID_FAMILIES) & present
            if status[mt][0] == "no_build"} == {}  # fmt: skip


def test_fallbacks_name_their_reason(results):
    for r in results:
        if r.status == "fallback":
            assert "[architecture]" in r.detail and len(r.detail) > 40, r


# ---- on CUDA --------------------------------------------------------------------------------------


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
