"""A text-generation pipeline as users start it, in a fresh process: over a list at its
default ``batch_size``, then over a ``KeyDataset``; stock beside ``backend="paged"``
(issue 23, acceptance 3). Stock's batch_size 1 is slow, so it runs the first prompts only; the
paged process also times ``LLM.generate`` on the same token ids (pipeline / LLM ratio)."""

from __future__ import annotations

import json
import random
import sys

import pytest

from tests.clients.suite import TARGETS, random_text, run_pair

pytestmark = pytest.mark.clients


def test_pipeline_list_and_keydataset(size, checkpoint, workroot, results):
    rng = random.Random(7)
    texts = [random_text(rng, rng.randint(16, 64)) for _ in range(size.pipeline_prompts)]
    out = workroot / "pipeline"
    out.mkdir()
    (out / "all.json").write_text(json.dumps(texts))
    (out / "head.json").write_text(json.dumps(texts[: size.stock_pipeline_prompts]))

    def cmd(prompts: str, result: str, *extra: str) -> list:
        return [sys.executable, TARGETS / "pipeline_client.py", "--model", checkpoint,
                "--prompts", out / prompts, "--new-tokens", size.pipeline_new_tokens,
                "--device", size.device, "--dtype", size.dtype, "--out", out / result,
                *extra]  # fmt: skip

    stock, paged = run_pair(size, "pipeline", cmd("head.json", "stock.json"),
                            cmd("all.json", "paged.json", "--paged"), out,
                            out / "stock.json")  # fmt: skip
    s = json.loads((out / "stock.json").read_text())
    p = json.loads((out / "paged.json").read_text())
    k = size.stock_pipeline_prompts
    assert p["list"][:k] == s["list"] and p["keydataset"][:k] == s["keydataset"]
    assert p["keydataset"] == p["list"] and len(p["list"]) == len(texts)
    n = len(texts)
    facts = {
        "prompts": n, "stock_prompts": k, "new_tokens": size.pipeline_new_tokens,
        "identical_strings": k,
        "pipeline_list_s": p["list_s"], "pipeline_keydataset_s": p["keydataset_s"],
        "llm_s": p["llm_s"], "pipeline_over_llm": p["llm_s"] / p["list_s"],
        "keydataset_over_llm": p["llm_s"] / p["keydataset_s"],
        "llm_texts_equal_pipeline": sum(a == b for a, b in zip(p["llm"], p["list"])),
        "stock_s_per_prompt": s["list_s"] / k, "paged_s_per_prompt": p["list_s"] / n,
        "stock_keydataset_s_per_prompt": s["keydataset_s"] / k,
    }  # fmt: skip
    results.add("pipeline", [stock, paged], **facts)
