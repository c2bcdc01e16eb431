"""lm-eval's own CLI, stock beside ``hf-paged run``, at issue 29's sizes: full runs and 8-doc runs.

For each task kind (``--kinds``: generate_until, multiple_choice, loglikelihood_rolling; the
documents of ``issue_docs``), ``--repeats`` times, in fresh
processes, alternating stock and ours:

    stock: python -m lm_eval --model hf --model_args pretrained=DIR,dtype=D --tasks T
           --include_path TASKS --device DEV --batch_size 16 --log_samples --output_path OUT
    ours:  python -m hf_paged.entrypoints.cli run -m lm_eval <the same arguments>

once on every document and once with ``--limit 8``. Per kind: the median wall time of each run,
"the work that grows with the task" (full minus 8-doc) of each side and their ratio (stock /
ours), the 8-doc difference (ours minus stock; the bar is <= 1 s), and what the full runs'
samples agree on (identical strings; same choice; largest loglikelihood difference).

Model: the Qwen3-0.6B shape with random bf16 weights (``random_models.build_random_model``) and a
byte-level BPE tokenizer trained here (``hf_paged.testing.build_bpe_tokenizer``, the model's
vocabulary), saved to safetensors; ``--smoke``: a tiny fp32 Qwen3 on the CPU, documents scaled
down. lm-eval and datasets travel to the GPU machine as wheels (``make gpu-wheels``).
Results: ``--out-dir`` (default ``$OUT`` or evaluation/results)/lm_eval_cli_<UTC>.json.

GPU, one kind per call (generate_until: ~5 min a repeat, stock's full run ~155 s; the others
~2-3 min a repeat):
    PYTHONPATH=/tmp/site:. python3 evaluation/run_lm_eval_cli.py --kinds multiple_choice --repeats 2
Smoke (CPU): PYTHONPATH=. .venv/bin/python evaluation/run_lm_eval_cli.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_dir import RESULTS_DIR

from hf_paged.benchmarks.lm_eval_tasks import KINDS, agreement, samples, write_task
from hf_paged.benchmarks.run_record import environment, log, utc_stamp

LIMIT = 8  # the run that measures what a process costs before any real work


def issue_docs(kind: str, scale: float = 1.0, seed: int = 0) -> list[dict]:
    """Issue 29's documents of ``kind``; ``scale`` < 1 shrinks counts and lengths (smoke runs).

    * generate_until: 384 docs, a 260-word prefix every doc shares, then a question of 10-30
      words and ``"\\nA:"``;
    * multiple_choice: 1,000 docs, contexts of 150-250 words, 4 choices of 1-4 words;
    * loglikelihood_rolling: 100 docs of 800-2,400 words.
    """
    from hf_paged.testing.tokenizer import random_words

    rng = random.Random(seed)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    def words(lo: int, hi: int) -> str:
        return random_words(rng, rng.randint(n(lo), n(hi)))

    if kind == "generate_until":
        prefix = random_words(rng, n(260))
        return [{"question": f"{prefix}\nQ{i}: {words(10, 30)}\nA:", "answer": words(1, 3)}
                for i in range(n(384))]  # fmt: skip
    if kind == "multiple_choice":
        return [{"question": words(150, 250) + "\nA:",
                 "choices": [" " + random_words(rng, rng.randint(1, 4)) for _ in range(4)],
                 "label": rng.randrange(4)} for _ in range(n(1000))]  # fmt: skip
    if kind == "loglikelihood_rolling":
        return [{"text": words(800, 2400)} for _ in range(n(100))]
    raise ValueError(f"kind={kind!r} is not allowed: must be one of {list(KINDS)}")


def build_checkpoint(folder: Path, smoke: bool) -> None:
    """Random weights and a BPE tokenizer of the model's vocabulary, saved to ``folder``."""
    from hf_paged.testing import build_bpe_tokenizer, save_tiny_model

    if smoke:
        save_tiny_model("qwen3", str(folder), vocab_size=512, max_position_embeddings=4096)
        build_bpe_tokenizer(vocab_size=512, merges=400).save_pretrained(folder)
        return
    import torch

    from hf_paged.benchmarks.random_models import build_random_model

    model = build_random_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16)
    model.save_pretrained(folder)
    build_bpe_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(folder)
    del model


def lm_eval_args(ckpt, dtype, task, tasks_dir, device, out, limit) -> list[str]:
    args = ["-m", "lm_eval", "--model", "hf", "--model_args", f"pretrained={ckpt},dtype={dtype}",
            "--tasks", task, "--include_path", str(tasks_dir), "--device", device,
            "--batch_size", "16", "--log_samples", "--output_path", str(out)]  # fmt: skip
    return args + (["--limit", str(limit)] if limit else [])


def run_process(side: str, args: list[str], timeout_s: int) -> dict:
    """One fresh process: ``python <args>`` (stock) or ``python -m hf_paged.entrypoints.cli run
    <args>`` (ours); its wall time and exit status."""
    cmd = [sys.executable, *args]
    if side == "paged":
        cmd = [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        log(f"{side} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    fell = "PagedFallbackWarning" in proc.stderr + proc.stdout
    return {"side": side, "wall_s": round(wall, 2), "rc": proc.returncode, "fallback": fell}


def run_kind(kind: str, args, ckpt: Path, work: Path) -> dict:
    task = f"issue29_{kind}"
    tasks_dir = work / "tasks"
    write_task(tasks_dir, task, kind, issue_docs(kind, scale=0.05 if args.smoke else 1.0),
               max_gen_toks=16 if args.smoke else 128)  # fmt: skip
    dtype = "float32" if args.smoke else "bfloat16"
    device = "cpu" if args.smoke else args.device
    runs = []
    for rep in range(args.repeats):
        for limit in (None, LIMIT):
            for side in ("hf", "paged") if rep % 2 == 0 else ("paged", "hf"):
                out = work / f"{kind}_{side}_{limit or 'full'}_{rep}"
                a = lm_eval_args(ckpt, dtype, task, tasks_dir, device, out, limit)
                r = run_process("paged" if side == "paged" else "stock", a, args.timeout)
                r.update(limit=limit or "full", repeat=rep, out=str(out))
                log(f"{kind} {r['side']} {r['limit']} #{rep}: {r['wall_s']} s (rc {r['rc']})")
                runs.append(r)

    def med(side, limit):
        xs = [r["wall_s"] for r in runs if r["side"] == side and r["limit"] == limit
              and r["rc"] == 0]  # fmt: skip
        return statistics.median(xs) if xs else None

    row = {"kind": kind, "runs": runs}
    for side in ("stock", "paged"):
        full, few = med(side, "full"), med(side, LIMIT)
        row[side] = {
            "full_s": full,
            f"limit{LIMIT}_s": few,
            "growing_s": None if None in (full, few) else round(full - few, 2),
        }
    g_s, g_p = row["stock"]["growing_s"], row["paged"]["growing_s"]
    row["growing_ratio"] = round(g_s / g_p, 2) if g_s and g_p and g_p > 0 else None
    few_s, few_p = row["stock"][f"limit{LIMIT}_s"], row["paged"][f"limit{LIMIT}_s"]
    row[f"limit{LIMIT}_paged_minus_stock_s"] = (
        None if None in (few_s, few_p) else round(few_p - few_s, 2)
    )
    first = {r["side"]: Path(r["out"]) for r in runs if r["limit"] == "full" and r["repeat"] == 0}
    row["agreement"] = agreement(kind, samples(first.get("stock"), task),
                                 samples(first.get("paged"), task))  # fmt: skip
    return row


def markdown(rows: list[dict]) -> str:
    lines = [
        "| task | stock full / 8-doc (s) | ours full / 8-doc (s) | growing: stock / ours (s) "
        "| ratio | 8-doc ours - stock (s) | agreement |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s, p = r["stock"], r["paged"]
        lines.append(f"| {r['kind']} | {s['full_s']} / {s[f'limit{LIMIT}_s']} | {p['full_s']} / "
                     f"{p[f'limit{LIMIT}_s']} | {s['growing_s']} / {p['growing_s']} | "
                     f"{'n/a' if r['growing_ratio'] is None else str(r['growing_ratio']) + 'x'} | {r[f'limit{LIMIT}_paged_minus_stock_s']} | "
                     f"{json.dumps(r['agreement'])} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kinds", default=",".join(KINDS), help="comma-separated task kinds")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", default="cuda")
    p.add_argument("--timeout", type=int, default=400, help="seconds per process")
    p.add_argument("--work-dir", default=None, help="checkpoint, tasks and outputs (default: tmp)")
    p.add_argument("--out-dir", default=os.environ.get("OUT") or str(RESULTS_DIR))
    p.add_argument("--smoke", action="store_true", help="tiny fp32 model on the CPU, few docs")
    args = p.parse_args(argv)
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KINDS]
    if bad or args.repeats < 1:
        p.error(f"--kinds {bad} / --repeats {args.repeats} not allowed: kinds from {list(KINDS)}, "
                "repeats >= 1")  # fmt: skip
    import tempfile

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="lm_eval_cli_"))
    ckpt = work / "checkpoint"
    if not (ckpt / "config.json").exists():
        log(f"building the checkpoint in {ckpt}")
        build_checkpoint(ckpt, args.smoke)
    rows = [run_kind(kind, args, ckpt, work) for kind in kinds]
    table = markdown(rows)
    print(table)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"lm_eval_cli_{'smoke_' if args.smoke else ''}{utc_stamp()}.json"
    path.write_text(json.dumps({"benchmark": "lm_eval_cli", "smoke": args.smoke,
                                "env": environment(), "rows": rows, "table_markdown": table},
                               indent=1) + "\n")  # fmt: skip
    log(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
