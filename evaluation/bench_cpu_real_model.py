"""CPU benchmark on the demo model (SmolLM2-135M-Instruct): stock ``generate`` against
``generate(backend="paged")``, ``LLM`` and a text-generation pipeline at ``batch_size=1``.

One command (the model folder is written first when missing, see ``hf-paged fetch-demo-model``):

    PYTHONPATH=. OMP_NUM_THREADS=1 python evaluation/bench_cpu_real_model.py

Workloads, each in fp32 and bf16, greedy, every request exactly ``--new-tokens`` new tokens
(``min_new_tokens`` / ``min_tokens`` hold EOS back, the same for stock and ours):

* ``batch1``: one chat prompt alone (ms per new token).
* ``batch32_nocache`` / ``batch32_cache``: the 32 chat prompts (36-219 tokens) in one call,
  prefix caching off / on (stock: one left-padded batch).
* ``pipeline_bs1``: ``pipeline("text-generation")`` over ``--pipeline-prompts`` chats with
  ``batch_size=1``, stock and ``backend="paged"``.

Every workload runs its systems interleaved (stock, then ours) ``--reps`` times in this one
process, after one untimed warm-up of each; wall time and this process's CPU time are recorded
per run, and the table reports min and median and the ratio stock / ours of the medians. On a
machine shared with other work the CPU-time ratio is the steadier one. Engines are built before
timing (their start is not timed). Writes ``--out`` (default
``evaluation/results/cpu_real_model.json``) with the environment (git sha, host) and a markdown
table; ``--quick`` is a smoke run (1 rep, 16 new tokens, fewer prompts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log, markdown_table

SYSTEMS = ("stock", "generate_paged", "llm", "pipeline_stock", "pipeline_paged")


def _timed(fn) -> tuple[float, float, object]:
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


class Bench:
    def __init__(self, path: str, dtype: torch.dtype, new_tokens: int, pipeline_prompts: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from hf_paged import LLM
        from hf_paged.testing.chat_prompts import QUESTIONS, chat_ids

        self.path, self.dtype, self.new = path, dtype, new_tokens
        self.tok = AutoTokenizer.from_pretrained(path)
        self.tok.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
        self.questions = QUESTIONS
        self.ids = chat_ids(self.tok)
        self.chats = [[{"role": "user", "content": q}] for q in QUESTIONS[:pipeline_prompts]]
        name = "float32" if dtype == torch.float32 else "bfloat16"
        self.llms = {pc: LLM(path, dtype=name, enable_prefix_caching=pc) for pc in (False, True)}
        self.gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def close(self) -> None:
        import hf_paged

        for llm in self.llms.values():
            llm.close()
        hf_paged.release(self.model)

    # ---- one run of a system on a workload: returns its new tokens per request ----

    def stock(self, prompts: list[list[int]], **_):
        batch = self.tok.pad({"input_ids": prompts}, return_tensors="pt")
        out = self.model.generate(**batch, **self.gen)
        return out[:, batch["input_ids"].shape[1] :].tolist()

    def generate_paged(self, prompts: list[list[int]], prefix_caching: bool = True):
        batch = self.tok.pad({"input_ids": prompts}, return_tensors="pt")
        cfg = {"enable_prefix_caching": prefix_caching, "dtype": "auto"}
        out = self.model.generate(**batch, **self.gen, backend="paged", paged_config=cfg)
        return out[:, batch["input_ids"].shape[1] :].tolist()

    def llm(self, prompts: list[list[int]], prefix_caching: bool = True):
        from hf_paged import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=self.new, min_tokens=self.new)
        outs = self.llms[prefix_caching].generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
        )
        return [list(o.outputs[0].token_ids) for o in outs]

    def pipeline(self, paged: bool):
        from transformers import pipeline

        extra = {"backend": "paged"} if paged else {}
        pipe = pipeline("text-generation", model=self.model, tokenizer=self.tok, **extra)
        outs = pipe(self.chats, batch_size=1, **self.gen)
        return [o[0]["generated_text"][-1]["content"] for o in outs]


def workload_plans(bench: Bench) -> dict:
    """Workload name -> {system: a run of it}; the first system is the baseline."""
    one, all32 = [bench.ids[0]], bench.ids
    return {
        "batch1": {"stock": lambda: bench.stock(one),
                   "generate_paged": lambda: bench.generate_paged(one),
                   "llm": lambda: bench.llm(one)},
        "batch32_nocache": {"stock": lambda: bench.stock(all32),
                            "generate_paged": lambda: bench.generate_paged(all32, False),
                            "llm": lambda: bench.llm(all32, False)},
        "batch32_cache": {"stock": lambda: bench.stock(all32),
                          "generate_paged": lambda: bench.generate_paged(all32, True),
                          "llm": lambda: bench.llm(all32, True)},
        "pipeline_bs1": {"pipeline_stock": lambda: bench.pipeline(False),
                         "pipeline_paged": lambda: bench.pipeline(True)},
    }  # fmt: skip


def run_workload(bench: Bench, name: str, systems: dict, reps: int) -> dict:
    """Warm each system once, then ``reps`` interleaved timed runs of every system."""
    runs = {s: {"wall_s": [], "cpu_s": []} for s in systems}
    outputs = {}
    for s, fn in systems.items():
        outputs[s] = fn()
    for r in range(reps):
        for s, fn in systems.items():
            wall, cpu, out = _timed(fn)
            runs[s]["wall_s"].append(wall)
            runs[s]["cpu_s"].append(cpu)
            outputs[s] = out
            log(f"{name} rep {r}: {s} {wall:.2f} s wall, {cpu:.2f} s cpu")
    stock_key = next(iter(systems))
    for s in systems:
        for k in ("wall_s", "cpu_s"):
            v = runs[s][k]
            runs[s][k.replace("_s", "_min_s")] = min(v)
            runs[s][k.replace("_s", "_median_s")] = statistics.median(v)
        runs[s]["same_as_stock"] = outputs[s] == outputs[stock_key]
        if s != stock_key:
            for k in ("wall", "cpu"):
                base = runs[stock_key][f"{k}_median_s"]
                runs[s][f"speedup_{k}_median"] = base / runs[s][f"{k}_median_s"]
    return runs


def main() -> None:
    from hf_paged.entrypoints.demo_model import DEFAULT_DIR, fetch_demo_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=DEFAULT_DIR)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--pipeline-prompts", type=int, default=32)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--workloads", default="batch1,batch32_nocache,batch32_cache,pipeline_bs1")
    p.add_argument("--quick", action="store_true", help="1 rep, 16 new tokens, 4 pipeline chats")
    p.add_argument("--out", default=str(RESULTS_DIR / "cpu_real_model.json"))
    args = p.parse_args()
    if args.quick:
        args.reps, args.new_tokens, args.pipeline_prompts = 1, 16, 4
    path, _ = fetch_demo_model(args.model)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    result = {"environment": environment(), "threads": torch.get_num_threads(),
              "new_tokens": args.new_tokens, "reps": args.reps, "workloads": {}}  # fmt: skip
    rows = []
    for dname in args.dtypes.split(","):
        bench = Bench(path, getattr(torch, dname), args.new_tokens, args.pipeline_prompts)
        plans = workload_plans(bench)
        for name in args.workloads.split(","):
            log(f"{dname} {name}")
            runs = run_workload(bench, name, plans[name], args.reps)
            result["workloads"][f"{dname}/{name}"] = runs
            base = next(iter(runs))
            for s, r in runs.items():
                rows.append([dname, name, s, f"{r['wall_min_s']:.2f}", f"{r['wall_median_s']:.2f}",
                             f"{r['cpu_median_s']:.2f}",
                             "-" if s == base else f"{r['speedup_wall_median']:.2f}x",
                             "-" if s == base else f"{r['speedup_cpu_median']:.2f}x",
                             r["same_as_stock"]])  # fmt: skip
        bench.close()
    header = ["dtype", "workload", "system", "wall min s", "wall median s", "cpu median s",
              "speed-up (wall)", "speed-up (cpu)", "same as stock"]  # fmt: skip
    result["table_md"] = markdown_table(header, rows)
    print(result["table_md"])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
