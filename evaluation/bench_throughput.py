"""Offline throughput, W1 / W2 (evaluation/README.md, "Workloads"), every system in one process.

Systems (rows), all greedy, EOS ignored, each request exactly its own number of new tokens:

* ``stock``: HF ``generate`` (sdpa), left-padded batches of ``--stock-batch-size``; a
  StoppingCriteria marks row i done after ``out_len[i]`` tokens (stock has one
  ``max_new_tokens`` per call, so the batch runs to its longest row, as stock does).
* ``cb``: transformers' own continuous batching (``paged|sdpa``) through its manager
  (``continuous_batching_context_manager`` + ``add_request(max_new_tokens=out_len[i])``):
  ``generate_batch`` itself takes one ``max_new_tokens`` for all requests.
* ``llm``: ``hf_paged.LLM(model)`` sharing the HF model's weights, one SamplingParams per
  request (``max_tokens=out_len[i]``). Also run on the baseline subset (fresh engine, so no
  prefix-cache carry-over) when the two request counts differ. With
  ``--tensor-parallel-size N`` > 1 the engine gets a safetensors checkpoint of the model saved to
  a temp dir (each rank loads its shard from it); the other rows keep the in-memory model.
* ``dispatch``: the ``stock`` calls with ``backend="paged"`` added (the generate dispatcher). The
  per-row StoppingCriteria sends it down the external-sampling path (HF's criteria run on every
  step's logits), and like stock every row runs to the batch's longest. Skipped at
  ``--tensor-parallel-size`` > 1: the dispatcher serves an in-memory model, which only tp=1 can.

Metric: requested output tokens / wall seconds, after an excluded warm-up (engine start-up,
CUDA-graph capture and the CB manager's warm-up are excluded too). Baselines are slow, so they
run on the first ``--baseline-requests`` requests (default 64 = one stock batch); ``llm`` on
``--our-requests`` (default 256). Results: evaluation/results/throughput_<W>_<UTC>.json + .png.

Usage (GPU): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_throughput.py --workload W1
Smoke (CPU): PYTHONPATH=. .venv/bin/python evaluation/bench_throughput.py --smoke
TP (GPU): add ``--tensor-parallel-size 2``; on CPU ``--smoke --tensor-parallel-size 2`` (gloo).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, mem_str, sync
from hf_paged.benchmarks.random_models import build_random_model, engine_source, weight_bytes
from hf_paged.benchmarks.run_record import environment, log, markdown_table
from hf_paged.benchmarks.runners import (
    LABELS,
    SYSTEMS,
    agreement,
    generate_batches,
    run_cb,
    run_dispatch,
    run_llm,
    run_stock,
)
from hf_paged.benchmarks.workloads import Workload, get_workload


def check_agreement(model, wl, results, k, batch_size, device) -> dict:
    by = {r["system"]: r for r in results if "outputs" in r}
    if "stock" in by and by["stock"]["requests"] >= k:
        ref = by["stock"]["outputs"][:k]
    else:  # untimed stock run on the first k requests
        log(f"agreement: stock generate on the first {k} requests (untimed)")
        ref = generate_batches(model, wl.head(k), batch_size, device)
    out = {}
    for name in ("llm", "llm_subset", "dispatch"):
        if name in by and by[name]["requests"] >= k:
            out[name] = agreement(ref, by[name]["outputs"][:k])
            log(f"agreement {name} vs stock (first {k}): {out[name]}")
    return out


def plot(results: list[dict], title: str, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return False
    rows = [r for r in results if "tok_per_s" in r]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(rows) + 1.5))
    names = [f"{r['label']}\n({r['requests']} requests)" for r in rows]
    vals = [r["tok_per_s"] for r in rows]
    bars = ax.barh(names[::-1], vals[::-1], color="tab:blue")
    for b, v in zip(bars, vals[::-1]):
        ax.text(b.get_width(), b.get_y() + b.get_height() / 2, f" {v:,.0f}", va="center")
    ax.set_xlabel("output tokens / s")
    ax.set_title(title, fontsize=9)
    ax.set_xlim(0, max(vals) * 1.2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def report(wl: Workload, results: list[dict], meta: dict, out_dir: Path) -> Path:
    stock = next((r for r in results if r["system"] == "stock" and "tok_per_s" in r), None)
    for r in results:
        if stock is not None and "tok_per_s" in r:
            r["vs_stock"] = r["tok_per_s"] / stock["tok_per_s"]
    rows = [
        [r["label"], r.get("requests", "-"), r.get("output_tokens", "-"),
         f"{r['wall_s']:.2f}" if "wall_s" in r else "-",
         f"{r['tok_per_s']:.1f}" if "tok_per_s" in r else f"skipped: {r.get('skipped')}",
         f"{r['vs_stock']:.2f}x" if "vs_stock" in r else "-"]
        for r in results
    ]  # fmt: skip
    table = markdown_table(["system", "requests", "output tokens", "wall s", "tok/s", "vs stock"],
                           rows)  # fmt: skip
    print(f"\n### {wl.name} ({wl.arch}) on {meta['env']['gpu'] or 'cpu'}\n\n{table}\n", flush=True)
    stamp = meta["env"]["date_utc"]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"throughput_{wl.name}_{stamp}.json"
    saved = [{k: v for k, v in r.items() if k != "outputs"} for r in results]
    doc = {**meta, "systems": saved, "table_markdown": table,
           "ratios_vs_stock": {r["system"]: r["vs_stock"] for r in saved if "vs_stock" in r}}  # fmt: skip
    path.write_text(json.dumps(doc, indent=1, default=str))
    title = (f"{wl.name}: {wl.arch}, {meta['env']['gpu'] or 'cpu'}, "
             f"{(meta['env']['git_sha'] or '?')[:10]}")  # fmt: skip
    if plot(results, title, path.with_suffix(".png")):
        log(f"wrote {path} and {path.with_suffix('.png').name}")
    else:
        log(f"wrote {path}")
    return path


# ---- main -------------------------------------------------------------------------------------


def engine_kwargs_from(args) -> dict:
    kw = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_model_len": args.max_model_len,
        "enforce_eager": args.enforce_eager,
        "async_scheduling": (False if args.sync_scheduling else None),
        "enable_prefix_caching": not args.no_prefix_caching,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "attention_backend": args.attention_backend,
    }
    return {k: v for k, v in kw.items() if v is not None}


def run_workload(name: str, args) -> Path:
    wl = get_workload(name, smoke=args.smoke)
    device = "cpu" if args.smoke else args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16
    base = wl.head(args.baseline_requests)
    ours = wl.head(args.our_requests)
    ekw = engine_kwargs_from(args)
    log(f"{name}: {wl.arch}, {wl.num_requests} requests; baselines on {base.num_requests} "
        f"({base.num_output_tokens} tokens), ours on {ours.num_requests} "
        f"({ours.num_output_tokens} tokens); engine {ekw}")  # fmt: skip
    t = time.perf_counter()
    model = build_random_model(wl.arch, device, dtype)
    sync(device)
    log(f"model built in {time.perf_counter() - t:.1f} s ({weight_bytes(model) / 1e9:.2f} GB)")

    results = []
    if "stock" in args.systems:
        log(f"stock: start ({mem_str(device)})")
        results.append(run_stock(model, base, args.stock_batch_size, device))
        free_memory(device)
    if "cb" in args.systems:
        log(f"cb: start ({mem_str(device)})")
        try:
            results.append(run_cb(model, base, device))
        except Exception as e:  # noqa: BLE001 - report the row as failed, keep the others
            log(f"cb: FAILED: {e!r}")
            results.append({"system": "cb", "label": LABELS["cb"], "skipped": f"failed: {e!r}"})
        free_memory(device)
    if "llm" in args.systems:
        with engine_source(model, args.tensor_parallel_size, args.tmp_dir) as (source, extra):
            log(f"llm: start ({mem_str(device)})")
            results.append(run_llm(source, ours, {**ekw, **extra}, device))
            if base.num_requests != ours.num_requests and not args.no_llm_subset:
                results.append(run_llm(source, base, {**ekw, **extra}, device, system="llm_subset"))
    if "dispatch" in args.systems and args.tensor_parallel_size > 1:
        why = "tensor_parallel_size > 1: generate(backend='paged') serves the in-memory model"
        log(f"dispatch: skipped ({why})")
        results.append({"system": "dispatch", "label": LABELS["dispatch"], "skipped": why})
    elif "dispatch" in args.systems:
        log(f"dispatch: start ({mem_str(device)})")
        n = args.dispatch_requests or base.num_requests
        results.append(run_dispatch(model, wl.head(n), args.stock_batch_size, device, ekw))
    if args.check_agreement:
        k = min(args.check_agreement, wl.num_requests)
        agree = check_agreement(model, wl, results, k, args.stock_batch_size, device)
    else:
        agree = {}
    meta = {
        "benchmark": "throughput", "workload": name, "arch": wl.arch, "smoke": args.smoke,
        "env": environment(), "dtype": str(dtype), "device": device,
        "weight_bytes": weight_bytes(model), "engine_kwargs": ekw,
        "tensor_parallel_size": args.tensor_parallel_size,
        "workload_spec": {"requests": wl.num_requests, "prompt_tokens": wl.num_prompt_tokens,
                          "output_tokens": wl.num_output_tokens,
                          "baseline_requests": base.num_requests,
                          "our_requests": ours.num_requests},
        "agreement_vs_stock": agree,
    }  # fmt: skip
    path = report(wl, results, meta, Path(args.out_dir))
    del model
    free_memory(device)
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", nargs="+", default=["W1"], choices=["W1", "W2"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument(
        "--baseline-requests",
        type=int,
        default=64,
        help="stock / cb run on the first N requests (default 64 = one stock batch)",
    )
    p.add_argument("--our-requests", type=int, default=256, help="hf_paged LLM runs on N")
    p.add_argument(
        "--dispatch-requests",
        type=int,
        default=None,
        help="generate(backend='paged') runs on N (default: --baseline-requests)",
    )
    p.add_argument(
        "--no-llm-subset", action="store_true", help="skip hf_paged LLM on the baseline subset"
    )
    p.add_argument("--stock-batch-size", type=int, default=64)
    p.add_argument(
        "--check-agreement",
        type=int,
        default=0,
        metavar="K",
        help="greedy-token agreement with stock generate on the first K requests",
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument(
        "--max-model-len",
        type=int,
        default=4096,
        help="engine max_model_len (nano-vllm's bench uses 4096; W1/W2 need 2048)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="async_scheduling=False (default: the engine's auto, on for one CUDA rank)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--attention-backend", default=None)
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks of the hf_paged LLM rows (N > 1: the engine loads a checkpoint saved to a "
        "temp dir; the baselines keep the in-memory model)",
    )
    p.add_argument("--tmp-dir", default=None, help="where the tp > 1 checkpoint is saved")
    p.add_argument("--out-dir", default=None)
    p.add_argument(
        "--smoke", action="store_true", help="CPU, fp32, tiny model, 8 short requests, batches of 4"
    )
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    if args.smoke:
        args.baseline_requests = min(args.baseline_requests, 8)
        args.our_requests = min(args.our_requests, 8)
        args.stock_batch_size = 4
        args.max_model_len = None
        args.out_dir = args.out_dir or "/tmp/hf_paged_bench_smoke"
    args.out_dir = args.out_dir or str(RESULTS_DIR)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    for name in args.workload:
        run_workload(name, args)


if __name__ == "__main__":
    main()
