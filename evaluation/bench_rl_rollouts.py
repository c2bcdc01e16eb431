"""GRPO rollout time per step, paged vs stock: TRL's GRPOTrainer on the CPU, each backend in a
fresh process, the wall time of every step's ``generate`` call (the rollouts) recorded.

    PYTHONPATH=. .venv/bin/python evaluation/bench_rl_rollouts.py [--steps 6] [--hidden 256]
        [--layers 4] [--completion 128] [--generations 8] [--fp32] [--model CKPT] [--out FILE]

A random Qwen3 of ``--hidden`` / ``--layers`` with the char tokenizer is built locally (or
``--model`` names a checkpoint directory with its tokenizer). The trainer runs at TRL's defaults
but for the sizes above, ``use_cpu`` and greedy generation: ``bf16`` is TRL's default (True:
accelerate's bf16 autocast around the forward, which the engine runs under too), ``--fp32``
turns it off. Greedy, so the two runs' rollouts are compared too. The first step includes the
engine's start; the median is taken over the later steps. Writes the per-step times, their
medians, whether the rollouts matched, the paged run's fallbacks (none expected) and engine
starts, the git sha and the load average to ``evaluation/results/rl_rollouts_<UTC>.json`` (or
``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):", "1, 2, 3,",
           "Q: what is 2+2? A:", "Once upon a time", "The quick brown fox", "import torch"]  # fmt: skip


def _policy(args) -> str:
    if args.model:
        return args.model
    from hf_paged.testing import build_char_tokenizer, save_tiny_model

    path = os.path.join(tempfile.mkdtemp(), "policy")
    tok = build_char_tokenizer()
    save_tiny_model("qwen3", path, seed=0, vocab_size=len(tok), hidden_size=args.hidden,
                    intermediate_size=args.hidden * 3, num_hidden_layers=args.layers,
                    max_position_embeddings=2048)  # fmt: skip
    tok.save_pretrained(path)
    return path


def worker(args) -> dict:
    """One backend's run in this process: per-step rollout seconds and the completions."""
    import hf_paged
    from hf_paged.integration.engine_owner import existing_owner

    if args.backend == "paged":
        hf_paged.set_default_backend("paged")
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(args.policy)
    tokenizer = AutoTokenizer.from_pretrained(args.policy)
    times, rollouts = [], []
    generate = model.generate

    def timed_generate(*a, **kw):  # the rollouts of one step
        start = time.perf_counter()
        out = generate(*a, **kw)
        times.append(time.perf_counter() - start)
        return out

    model.generate = timed_generate

    def reward(completions, **kwargs):
        rollouts.append(list(completions))
        return [sum(c in "aeiou" for c in t) / max(len(t), 1) for t in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), use_cpu=True, max_steps=args.steps,
        **({"bf16": False} if args.fp32 else {}),  # else TRL's default: bf16 autocast
        generation_kwargs={"do_sample": False}, report_to="none", save_strategy="no",
        max_completion_length=args.completion, num_generations=args.generations,
        per_device_train_batch_size=args.generations, logging_steps=1000,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                          processing_class=tokenizer)  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hf_paged.PagedFallbackWarning)
        trainer.train()
    fallbacks = [str(w.message) for w in caught
                 if issubclass(w.category, hf_paged.PagedFallbackWarning)]  # fmt: skip
    owner = existing_owner(model)
    return {"rollout_s": [round(t, 4) for t in times], "rollouts": rollouts,
            "fallbacks": fallbacks, "engine_starts": owner.builds if owner else 0}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--completion", type=int, default=128)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--fp32", action="store_true", help="bf16=False (TRL's default is True)")
    p.add_argument("--model")
    p.add_argument("--out")
    p.add_argument("--backend", choices=["paged", "hf"], help=argparse.SUPPRESS)  # worker
    p.add_argument("--policy", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.backend:
        Path(args.result).write_text(json.dumps(worker(args)))
        return
    policy = _policy(args)
    runs = {}
    for backend in ("hf", "paged"):
        result = Path(tempfile.mkdtemp()) / f"{backend}.json"
        cmd = [sys.executable, __file__, "--backend", backend, "--policy", policy, "--result",
               str(result), "--steps", str(args.steps), "--completion", str(args.completion),
               "--generations", str(args.generations)] + (["--fp32"] if args.fp32 else [])  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}
        subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
        runs[backend] = json.loads(result.read_text())
        later = runs[backend]["rollout_s"][1:] or runs[backend]["rollout_s"]
        runs[backend]["median_later_steps_s"] = round(statistics.median(later), 4)
        print(f"{backend:<6} rollout s per step: {runs[backend]['rollout_s']}  "
              f"median after step 1: {runs[backend]['median_later_steps_s']}")  # fmt: skip
    same = runs["hf"].pop("rollouts") == runs["paged"].pop("rollouts")
    ratio = runs["paged"]["median_later_steps_s"] / runs["hf"]["median_later_steps_s"]
    print(f"paged / stock (median after step 1): {ratio:.2f}; rollouts identical: {same}; "
          f"paged fallbacks: {len(runs['paged']['fallbacks'])}, engine starts: "
          f"{runs['paged']['engine_starts']}")  # fmt: skip
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out or ROOT / "evaluation" / "results" / f"rl_rollouts_{stamp}.json")
    out.write_text(json.dumps({
        "benchmark": "rl_rollouts", "git_sha": sha, "machine": os.uname().nodename,
        "cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
        "model": args.model or f"random qwen3 hidden {args.hidden}, {args.layers} layers",
        "steps": args.steps, "completion_tokens": args.completion,
        "generations": args.generations, "rollouts_identical": same,
        "precision": "fp32 (bf16=False)" if args.fp32 else "TRL default bf16=True (autocast)",
        "paged_over_stock": round(ratio, 3), "runs": runs,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
