"""Engine start, build to the first token, in fresh processes (issue 23, acceptance 5): a cold
Triton cache (an empty ``TRITON_CACHE_DIR``: every kernel compiles) and then a warm one (the
same directory). On CPU there is no Triton: both runs time the same start."""

from __future__ import annotations

import json
import sys

import pytest

from tests.clients.suite import TARGETS, run_one

pytestmark = pytest.mark.clients


def test_engine_start_cold_and_warm_triton_cache(size, checkpoint, workroot, results):
    out = workroot / "engine_start"
    cache = out / "triton_cache"
    runs, docs = [], {}
    for label in ("cold", "warm"):
        cmd = [sys.executable, TARGETS / "engine_start.py", "--model", checkpoint, "--dtype",
               size.dtype, "--out", out / f"{label}.json"]  # fmt: skip
        runs.append(run_one(size, f"engine_start_{label}", "paged", cmd, out,
                            TRITON_CACHE_DIR=str(cache)))  # fmt: skip
        docs[label] = json.loads((out / f"{label}.json").read_text())
    if size.device == "cuda":
        assert any(cache.iterdir()), "the cold run compiled nothing into TRITON_CACHE_DIR"
        assert docs["cold"]["cuda_graphs"] and docs["warm"]["cuda_graphs"]
    for doc in docs.values():
        assert doc["num_kv_blocks"] > 0
    results.add("engine_start", runs, **{f"{k}_build_to_first_token_s": v["build_to_first_token_s"]
                                         for k, v in docs.items()}, detail=docs)  # fmt: skip
