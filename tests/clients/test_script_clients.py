"""Two clients of whole scripts, each in a fresh process beside stock: ``hf-paged run`` on an
unmodified HF script (left-padded batched ``generate``), and ``datasets.map`` with
``hf_paged.paged_generate_map`` against stock ``generate`` on each row alone."""

from __future__ import annotations

import json
import sys

import pytest

from tests.clients.suite import TARGETS, run_one, run_pair

pytestmark = pytest.mark.clients


def test_hf_paged_run_on_an_unmodified_script(size, checkpoint, prompts, workroot, results):
    out = workroot / "hf_script"

    def cmd(result: str) -> list:
        return [TARGETS / "hf_script.py", "--model", checkpoint, "--prompts", prompts,
                "--new-tokens", size.new_tokens, "--device", size.device, "--dtype",
                size.dtype, "--out", out / result]  # fmt: skip

    stock, paged = run_pair(size, "hf_script", [sys.executable, *cmd("stock.json")],
                            [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", *cmd("paged.json")],
                            out, out / "stock.json")  # fmt: skip
    s = json.loads((out / "stock.json").read_text())
    p = json.loads((out / "paged.json").read_text())
    assert p == s, [i for i, (a, b) in enumerate(zip(s, p)) if a != b]
    assert paged.breakdown["engine_starts"] >= 1  # the paged run did go through the engine
    results.add("hf_paged_run_script", [stock, paged], prompts=len(s), identical_strings=len(s))


def test_datasets_map_helper(size, checkpoint, prompts, workroot, results, stock_reference):
    pytest.importorskip("datasets", reason="datasets is not installed (on the GPU image it "
                        "comes with the lm-eval wheels: make gpu-wheels)")  # fmt: skip
    ref, stock = stock_reference
    out = workroot / "datasets_map"
    cmd = [sys.executable, TARGETS / "datasets_map_client.py", "--model", checkpoint,
           "--prompts", prompts, "--new-tokens", size.new_tokens, "--dtype", size.dtype,
           "--out", out / "paged.json"]  # fmt: skip
    paged = run_one(size, "datasets_map", "paged", cmd, out)
    got = json.loads((out / "paged.json").read_text())
    assert got["texts"] == [r["text"] for r in ref]
    results.add("datasets_map", [stock, paged], prompts=len(ref), identical_strings=len(ref),
                map_s=got["map_s"], stock_is="stock generate on each row alone")  # fmt: skip
