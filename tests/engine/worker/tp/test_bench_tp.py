"""The throughput and latency benchmarks' CPU smoke mode at ``--tensor-parallel-size 2`` (gloo):
the engine gets a checkpoint saved to a temp dir, the result file records the rank count, the
tp=2 tokens equal stock ``generate``'s, and the temp checkpoint and the workers are gone after.

The benches run in this process (``main(argv)``): a subprocess each would pay torch's import
again on top of the worker's.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

import pytest

from tests.evaluation_scripts import load_evaluation_script


def only_result(out_dir: Path, pattern: str) -> dict:
    (path,) = out_dir.glob(pattern)
    return json.loads(path.read_text())


@pytest.fixture
def dirs(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "ckpt"
    tmp.mkdir()
    yield out, tmp
    assert not list(tmp.iterdir()), "the tp=2 checkpoint was not removed"
    assert not mp.active_children()


def test_throughput_smoke_tp2(dirs):
    out, tmp = dirs
    argv = ["--smoke", "--tensor-parallel-size", "2", "--systems", "stock", "llm", "dispatch",
            "--check-agreement", "8", "--out-dir", str(out), "--tmp-dir", str(tmp)]  # fmt: skip
    load_evaluation_script("bench_throughput").main(argv)
    doc = only_result(out, "throughput_W1_*.json")
    assert doc["tensor_parallel_size"] == 2
    rows = {r["system"]: r for r in doc["systems"]}
    assert rows["llm"]["engine_config"]["tensor_parallel_size"] == 2
    assert rows["llm"]["output_tokens"] == rows["stock"]["output_tokens"] > 0
    assert "tensor_parallel_size > 1" in rows["dispatch"]["skipped"]
    agree = doc["agreement_vs_stock"]["llm"]
    assert agree["requests"] == 8 and agree["exact_match_requests"] == 8


def test_latency_smoke_tp2(dirs):
    out, tmp = dirs
    argv = ["--smoke", "--tensor-parallel-size", "2", "--systems", "llm", "dynamic",
            "--repeats", "1", "--out-dir", str(out), "--tmp-dir", str(tmp)]  # fmt: skip
    load_evaluation_script("bench_latency").main(argv)
    doc = only_result(out, "latency_*.json")
    assert doc["tensor_parallel_size"] == 2
    rows = {r["system"]: r for r in doc["systems"]}
    llm = rows["llm"]
    assert llm["engine_config"]["tensor_parallel_size"] == 2 and llm["label"].endswith("tp=2")
    assert llm["tokens"] == rows["dynamic"]["tokens"] and len(llm["tokens"]) == 8
