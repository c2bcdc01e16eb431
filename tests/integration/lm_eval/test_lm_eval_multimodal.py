"""lm-eval's ``hf-multimodal`` backend through ``hf-paged run`` equals stock, sample by sample.

lm-eval's own CLI runs twice, as subprocesses at once: stock ``python -m lm_eval --model
hf-multimodal`` and ``hf-paged run -m lm_eval --model hf-multimodal``, on the task shipped in
``examples/lm_eval_tasks/tiny_vqa`` (20 docs, each with a 16x16 image generated from its
seed) over the tiny Gemma 3 of ``hf_paged/testing/vlm/frontends.py`` saved with its processor.
Gemma 3's processor expands its begin-of-image token, so lm-eval's ``<image>`` becomes
``image_string``.
"""

from __future__ import annotations

import glob
import json
import os
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")

from hf_paged.benchmarks.lm_eval_tasks import check_served, run_side_by_side, subprocess_env  # noqa: E402
from hf_paged.testing.vlm.frontends import save_gemma3  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TASKS = os.path.join(ROOT, "examples", "lm_eval_tasks")


def _cmd(model: str, out: str, paged: bool) -> list[str]:
    head = [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", "-m"] if paged else [
        sys.executable, "-m"]  # fmt: skip
    return head + [
        "lm_eval", "--model", "hf-multimodal",
        "--model_args", f"pretrained={model},dtype=float32,image_string=<start_of_image>",
        "--tasks", "tiny_vqa", "--include_path", TASKS, "--device", "cpu", "--batch_size", "1",
        "--output_path", out, "--log_samples",
    ]  # fmt: skip


def _samples(out: str) -> list[dict]:
    (path,) = glob.glob(f"{out}/*/samples_tiny_vqa_*.jsonl")
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm_eval_mm"))
    model = save_gemma3(os.path.join(root, "model"))
    cmds = {name: _cmd(model, os.path.join(root, name), paged)
            for name, paged in (("stock", False), ("paged", True))}  # fmt: skip
    # the task's data file is named relative to the repository root: run from there
    runs = run_side_by_side(cmds, subprocess_env(ROOT), ROOT, root, timeout=500)
    check_served(runs, ("hf_paged: engine ready",))  # the calls went to the engine
    return os.path.join(root, "stock"), os.path.join(root, "paged")


def test_same_strings_as_stock(runs):
    stock, paged = (_samples(out) for out in runs)
    assert len(stock) == len(paged) == 20
    for a, b in zip(stock, paged):
        assert a["arguments"] == b["arguments"]
        assert a["resps"] == b["resps"], (a["doc_id"], a["resps"], b["resps"])
    # the images reach the text: the docs' answers differ
    assert len({s["resps"][0][0] for s in stock}) > 10
