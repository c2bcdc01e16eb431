"""TRL's GRPOTrainer under ``hf-paged run`` (``examples/rl_grpo.py``: 5 steps at TRL's defaults
except ``use_cpu`` and greedy ``generation_kwargs``, so completions of up to 256 tokens, 8
generations of one prompt a step). TRL's default ``bf16=True`` puts accelerate's bf16 autocast around the model's forward:
the engine runs under the same autocast (its start says so). Every rollout runs on the paged
engine (``--report``), each step's rollouts equal stock's run of the same script, and one engine
serves all five steps (one start, so one KV cache allocation), its weights refreshed in place
after each optimizer step. The two runs are fresh processes started together. Also with
``--lora`` (TRL's ``peft_config``: the adapter trained, the engine serving it from LoRA slots),
for 2 steps of 32 tokens: there accelerate wraps the PeftModel's forward, which PEFT's
``generate`` does not call, so stock's rollouts and the engine's run without autocast."""

from __future__ import annotations

import json
import os

import pytest

from tests.entrypoints.cli.procs import finish, start_python

pytest.importorskip("trl")

RUNS = {  # name -> (steps, in-place refreshes of the engine's weights, autocast, arguments)
    "full": (5, 4, True, ["--steps", "5"]),
    # LoRA slots serve the adapter unmerged: its new factors reach a slot under a new key, the
    # base weights never change
    "lora": (2, 0, False, ["--steps", "2", "--max-completion-length", "32", "--lora"]),
}
UNDER_AUTOCAST = "under torch.autocast('cpu', dtype=torch.bfloat16)"


@pytest.mark.parametrize("run", sorted(RUNS))
def test_grpo_rollouts_run_paged_and_equal_stock(tmp_path, run):
    if run == "lora":
        pytest.importorskip("peft")
    steps, refreshes, autocast, args = RUNS[run]
    script = os.path.join("examples", "rl_grpo.py")
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    outs = {kind: str(tmp_path / f"{kind}.jsonl") for kind in ("paged", "stock")}
    procs = {
        "paged": start_python(["-m", "hf_paged.entrypoints.cli", "run", "--report", script,
                               *args, "--out", outs["paged"]], env),
        "stock": start_python(["-m", "hf_paged.entrypoints.cli", "run", "--backend", "hf",
                               script, *args, "--out", outs["stock"]], env),
    }  # fmt: skip
    try:
        done = {kind: finish(p, timeout=600) for kind, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()
    for kind, (code, _, err) in done.items():
        assert code == 0, f"{kind} exited with {code}:\n{err[-3000:]}"
    err = done["paged"][2]
    assert f"served by the paged engine: {steps} generate call(s)" in err, err[-3000:]
    assert "PagedFallbackWarning" not in err
    assert err.count("starting an engine") == 1, err[-3000:]  # no rebuild, no new KV cache
    assert err.count("changed weights refreshed in the engine") == refreshes
    assert (UNDER_AUTOCAST in err) == autocast, err[-3000:]
    paged, stock = ([json.loads(line) for line in open(outs[k])] for k in ("paged", "stock"))
    assert len(paged) == steps and all(len(step) == 8 for step in paged)
    for step, (p, s) in enumerate(zip(paged, stock, strict=True)):
        assert p == s, f"step {step}"
