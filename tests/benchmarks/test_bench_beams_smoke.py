"""``evaluation/bench_beams.py --smoke`` (tiny fp32 model on CPU): both systems run, the result
file has the ratio and the KV record, and every returned row equals stock's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.evaluation_scripts import load_evaluation_script


def test_bench_beams_smoke(tmp_path):
    bench = load_evaluation_script("bench_beams")
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        path = bench.main(["--smoke", "--out-dir", str(tmp_path)])
    finally:
        torch.set_num_threads(previous)
    doc = json.loads(Path(path).read_text())
    stock, paged = doc["systems"]
    assert (stock["system"], paged["system"]) == ("stock", "paged")
    assert stock["output_tokens"] == paged["output_tokens"] == 4 * 8
    assert doc["rows_equal_stock"] == doc["rows_compared"] == 4
    assert doc["ratio_paged_over_stock"] > 0
    assert paged["kv_blocks_last_step"] < paged["kv_blocks_unshared"]  # the beams share blocks
    assert paged["num_copied_blocks"] > 0
