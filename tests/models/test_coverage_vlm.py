"""Acceptance: every architecture in transformers' image-text-to-text mapping, built tiny from
its own config, is served by ``generate(backend="paged")`` with stock's greedy tokens or falls
back with a named reason; none fails. Prints the table (``tests/models/coverage_vlm.py``)."""

from __future__ import annotations

import pytest

from tests.models.coverage_report import run_and_print, summary
from tests.models.coverage_vlm import markdown_table, run_all

# measured 2026-12-05 on transformers 5.25: 24 served of the 25 that build tiny (78 do not)
MIN_SERVED = 20
# the issue's families (transformers' names) that must be served
MUST_SERVE = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "llava", "llava_next", "llava_onevision",
              "gemma3", "idefics3", "smolvlm", "llama4", "mistral3"}  # fmt: skip


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_and_print(run_all, markdown_table, tmp_path_factory.mktemp("coverage_vlm"))


def test_no_failures(results):
    assert [(r.model_type, r.detail) for r in results if r.status == "failure"] == []


def test_served_count(results):
    counts = summary(results)
    assert counts["served"] >= MIN_SERVED, counts


def test_issue_families_served(results):
    status = {r.model_type: (r.status, r.detail) for r in results}
    assert {mt: status[mt] for mt in MUST_SERVE if status[mt][0] != "served"} == {}


def test_fallbacks_name_their_reason(results):
    for r in results:
        if r.status == "fallback":
            assert "[" in r.detail and len(r.detail) > 40, r
