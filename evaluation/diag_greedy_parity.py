"""How often greedy rows agree, token for token, between stock batched, stock alone and ours.

The lm-eval generate_until client compares strings of 128 greedy tokens on a random-weight
Qwen3-0.6B. This script separates the engine's semantics from floating-point noise: on the same
prompts (a shared prefix plus a question, as that client's docs; sorted longest first and
left-padded in batches of ``--batch``, as lm-eval's HFLM does) it runs

* stock ``generate`` on the padded batches (what lm-eval's stock run does),
* stock ``generate`` on each of the first ``--alone`` rows alone (no padding),
* ``generate(backend="paged")`` on the same padded batches,

for each ``--dtypes`` entry, and reports for every pair the rows that are identical and where
the others first differ. In fp32 the engine must equal stock alone; in bf16 the stock-vs-stock
figure says how much a change of batch shape alone moves greedy tokens on this model.

Usage (GPU): PYTHONPATH=. python evaluation/diag_greedy_parity.py [--docs 64] [--dtypes bf16,fp32]
Smoke (CPU): PYTHONPATH=. python evaluation/diag_greedy_parity.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import environment, log, write_record

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def make_prompts(n: int, prefix_len: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of printable-ASCII ids: one shared prefix, a 10-40 token question each."""
    rng = random.Random(seed)
    chars = list(range(32, 127))
    prefix = [rng.choice(chars) for _ in range(prefix_len)]
    return [prefix + [10] + [rng.choice(chars) for _ in range(rng.randint(10, 40))] + [10]
            for _ in range(n)]  # fmt: skip


def left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids.to(device), mask.to(device)


def run_batches(model, prompts, batch: int, new: int, backend: str) -> tuple[list, float]:
    """Greedy new tokens per prompt (prompts already sorted), padded batches of ``batch``."""
    out, t0 = [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        ids, mask = left_padded(chunk, 0, model.device)
        seqs = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0,
                              backend=backend)  # fmt: skip
        out.extend(seqs[:, ids.shape[1] :].tolist())
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    n = min(len(a), len(b))
    firsts = []
    for x, y in zip(a[:n], b[:n], strict=True):
        d = next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), None)
        if d is not None:
            firsts.append(d)
    return {"rows": n, "identical": n - len(firsts), "first_difference_at": sorted(firsts)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=64)
    p.add_argument("--alone", type=int, default=16)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--prefix", type=int, default=400)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--dtypes", default="bf16,fp32")
    p.add_argument("--arch", default="qwen3-0.6b")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny model, 8 docs, 8 tokens")
    args = p.parse_args()
    import hf_paged  # noqa: F401  (installs the backend= dispatcher)

    if args.smoke:
        args.docs, args.alone, args.batch, args.prefix, args.new_tokens = 8, 4, 4, 20, 8
        args.dtypes, args.arch = "fp32", "tiny"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = sorted(make_prompts(args.docs, args.prefix), key=lambda r: -len(r))
    result = {"env": environment(), "args": vars(args), "runs": {}}
    for name in args.dtypes.split(","):
        if args.arch == "tiny":
            from hf_paged.testing import build_hf_model

            model = build_hf_model("qwen3", 0, vocab_size=128).to(device, DTYPES[name])
        else:
            model = build_random_model(args.arch, device=device, dtype=DTYPES[name])
        stock, t_stock = run_batches(model, prompts, args.batch, args.new_tokens, "hf")
        alone, t_alone = run_batches(model, prompts[: args.alone], 1, args.new_tokens, "hf")
        ours, t_ours = run_batches(model, prompts, args.batch, args.new_tokens, "paged")
        hf_paged.release(model)
        row = {
            "stock_batched_vs_stock_alone": agreement(stock, alone),
            "ours_vs_stock_alone": agreement(ours, alone),
            "ours_vs_stock_batched": agreement(ours, stock),
            "seconds": {"stock_batched": t_stock, "stock_alone": t_alone, "ours": t_ours},
        }
        result["runs"][name] = row
        log(f"{name}: " + json.dumps({k: (v["identical"], v["rows"]) if "rows" in v else v
                                      for k, v in row.items()}))  # fmt: skip
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    path = write_record(result, RESULTS_DIR, "greedy_parity")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
