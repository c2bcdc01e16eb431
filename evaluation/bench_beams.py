"""Beam search: stock ``generate`` vs ``generate(backend="paged")``, the same call, one process
(issue 25, acceptance 4, the beam part).

Workload B1: 32 prompts of 512 random token ids (< 10000, ``random.Random(0)``, as W1 draws
them), ``num_beams=4``, 256 new tokens, greedy beam search with stock's defaults
(``length_penalty=1.0``, ``early_stopping=False``), no EOS (the configs have none), so every
beam runs the full 256 steps in both systems. Model: the Llama-3-8B shape with random bf16
weights (``random_models.build_random_model``).

Systems, in this order (stock first: the engine then takes the memory stock freed):

* ``stock``: ``model.generate(input_ids [N, 512], attention_mask, num_beams=4,
  max_new_tokens=256, do_sample=False)`` on the first ``--stock-prompts`` prompts (default all
  32: the same call as ours), one call.
* ``paged``: the same call with ``backend="paged"`` on all 32 prompts; the engine is built and
  warmed up by an untimed small beam call first.

Metric: returned sequences' new tokens (prompts x 256) / wall time of the call, and the ratio
paged / stock. Also recorded: KV blocks in use at the last step against what 128 unshared
sequences would hold, copy-on-write copies, preemptions, and how many returned rows equal
stock's (bf16 on different kernels: beams may part where scores nearly tie; fp32 smoke runs
must agree on every row). Writes ``evaluation/results/beams_<stamp>.json``.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_beams.py            # H200
    PYTHONPATH=. python evaluation/bench_beams.py --smoke                        # CPU, tiny
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, mem_str, sync
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.benchmarks.workloads import make_requests


def prompts_tensor(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """Equal-length prompts as ``(input_ids [N, L], attention_mask [N, L])``."""
    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    return ids, torch.ones_like(ids)


def run_stock(model, prompts, kwargs: dict) -> tuple[dict, torch.Tensor]:
    ids, mask = prompts_tensor(prompts, model.device)
    model.generate(
        input_ids=ids[:1, :8], attention_mask=mask[:1, :8], **{**kwargs, "max_new_tokens": 2}
    )  # fmt: skip  (warm-up: cuBLAS handles, allocator)
    sync(model.device)
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    sync(model.device)
    wall = time.perf_counter() - t0
    row = _row("stock", wall, len(prompts) * kwargs["max_new_tokens"], num_prompts=len(prompts))
    log(f"stock done ({mem_str(model.device)})")
    return row, out.cpu()


def run_paged(model, prompts, kwargs: dict, engine_kwargs: dict) -> tuple[dict, torch.Tensor]:
    import hf_paged  # noqa: F401  (installs the generate dispatcher)
    from hf_paged.integration import dispatch

    ids, mask = prompts_tensor(prompts, model.device)
    paged = dict(kwargs, backend="paged", paged_config=engine_kwargs)
    try:
        t0 = time.perf_counter()
        model.generate(
            input_ids=ids[:2, :16], attention_mask=mask[:2, :16], **{**paged, "max_new_tokens": 8}
        )  # fmt: skip  (engine start, compiles, graphs)
        log(f"engine started and warmed up in {time.perf_counter() - t0:.1f} s")
        engine = dispatch.get_engine(model)
        bm, provide = engine.block_manager, engine.provide_beams
        used: list[int] = []

        def measuring(*args, **kw):  # blocks in use once a step's beams all have their KV
            used.append(bm.num_blocks - bm.num_free_blocks)
            return provide(*args, **kw)

        engine.provide_beams = measuring
        stats0 = engine.stats
        sync(model.device)
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **paged)
        sync(model.device)
        wall = time.perf_counter() - t0
        stats = engine.stats
        engine.provide_beams = provide
    finally:
        dispatch.release(model)
        free_memory(model.device)
    k, new, bs = kwargs["num_beams"], kwargs["max_new_tokens"], stats["num_kv_blocks"]
    # at the last step each beam has prompt + new - 1 tokens with KV
    per_beam = math.ceil((len(prompts[0]) + new - 1) / engine.config.kv_block_size)
    unshared = len(prompts) * k * per_beam
    delta = {key: stats[key] - stats0[key]
             for key in ("num_preemptions", "num_parked", "num_copied_blocks")}  # fmt: skip
    row = _row(
        "paged", wall, len(prompts) * new, num_prompts=len(prompts), num_kv_blocks=bs,
        kv_blocks_last_step=used[-1] if used else None, kv_blocks_peak=max(used, default=None),
        kv_blocks_unshared=unshared, max_num_running_seqs=stats["max_num_running_seqs"], **delta,
    )  # fmt: skip
    log(f"KV blocks at the last step {row['kv_blocks_last_step']} (peak {row['kv_blocks_peak']}"
        f"), unshared beams would hold {unshared}; {delta}")  # fmt: skip
    return row, out.cpu()


def _row(system: str, wall: float, tokens: int, **extra) -> dict:
    row = {"system": system, "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
           **extra}  # fmt: skip
    log(f"{system}: {tokens} tokens in {wall:.2f} s = {row['tok_per_s']:.1f} tok/s")
    return row


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny model, fp32, CPU, 4 short prompts")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--num-beams", type=int, default=4)
    p.add_argument("--stock-prompts", type=int, default=None, help="default: all prompts")
    p.add_argument("--skip-stock", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)

    if args.smoke:
        args.num_prompts, args.prompt_len, args.max_new_tokens = 4, 16, 8
    device = "cpu" if args.smoke else args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16
    arch = "tiny" if args.smoke else "llama3-8b"
    limit = 500 if args.smoke else 10000  # the tiny model's vocabulary has 512 ids
    prompts, _ = make_requests(args.num_prompts, (args.prompt_len,) * 2, (1, 1), vocab_limit=limit)
    kwargs = dict(num_beams=args.num_beams, max_new_tokens=args.max_new_tokens, do_sample=False)
    ekw = {"device": device, "max_model_len": args.prompt_len + args.max_new_tokens + 16}
    if args.smoke:
        ekw["num_kv_blocks"] = 64  # not the CPU default's 512 MiB
    if args.max_num_seqs is not None:
        ekw["max_num_seqs"] = args.max_num_seqs
    if args.enforce_eager:
        ekw["enforce_eager"] = True
    model = build_random_model(arch, device, dtype)
    log(f"B1: {args.num_prompts} prompts x {args.prompt_len} tokens, {kwargs}, {arch} {dtype}, "
        f"engine {ekw} ({mem_str(device)})")  # fmt: skip

    rows, stock_out = [], None
    n_stock = args.stock_prompts or args.num_prompts
    if not args.skip_stock:
        row, stock_out = run_stock(model, prompts[:n_stock], kwargs)
        rows.append(row)
        free_memory(device)
    row, paged_out = run_paged(model, prompts, kwargs, ekw)
    rows.append(row)
    doc = {
        "benchmark": "beams", "workload": "B1", "arch": arch, "smoke": args.smoke,
        "env": environment(), "dtype": str(dtype), "device": device, "engine_kwargs": ekw,
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
        "generate_kwargs": kwargs, "stock_prompts": None if args.skip_stock else n_stock,
        "systems": rows,
    }  # fmt: skip
    if stock_out is not None:
        mine = paged_out[: stock_out.shape[0]]  # the rows of stock's prompts
        same = 0
        if stock_out.shape == mine.shape:
            same = sum(bool(torch.equal(a, b)) for a, b in zip(stock_out, mine, strict=True))
        doc["rows_equal_stock"] = same
        doc["rows_compared"] = stock_out.shape[0]
        doc["ratio_paged_over_stock"] = rows[1]["tok_per_s"] / rows[0]["tok_per_s"]
        log(f"paged / stock = {doc['ratio_paged_over_stock']:.2f}x; {same}/{stock_out.shape[0]} "
            "returned rows equal stock's")  # fmt: skip
    path = write_record(doc, args.out_dir, f"beams{'_smoke' if args.smoke else ''}")
    log(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
