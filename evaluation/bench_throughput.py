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
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (  # noqa: E402
    RESULTS_DIR,
    TritonCompileLog,
    Workload,
    build_random_model,
    engine_source,
    environment,
    free_memory,
    get_workload,
    log,
    markdown_table,
    mem_str,
    sync,
    weight_bytes,
)

SYSTEMS = ("stock", "cb", "llm", "dispatch")
LABELS = {
    "stock": "HF generate (sdpa, padded batches)",
    "cb": "transformers CB (paged|sdpa)",
    "llm": "hf_paged LLM",
    "llm_subset": "hf_paged LLM (baseline subset)",
    "dispatch": 'hf_paged generate(backend="paged")',
}


class PerRowLength(StoppingCriteria):
    """Row i is done once it has ``lens[i]`` new tokens past the padded prompt width."""

    def __init__(self, prompt_width: int, lens: list[int], device):
        self.prompt_width = prompt_width
        self.lens = torch.tensor(lens, device=device)  # [B]

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.lens  # [B]


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` [B, L], pads (id 0) on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _result(system: str, wl: Workload, wall: float, outputs: list[list[int]], **extra) -> dict:
    got = [len(o) for o in outputs]
    short = [i for i, (g, w) in enumerate(zip(got, wl.output_lens)) if g < w]
    if short:
        raise RuntimeError(f"{system}: requests {short[:8]} got fewer tokens than requested")
    tokens = wl.num_output_tokens
    log(f"{system}: {wl.num_requests} requests, {tokens} tokens, {wall:.2f} s, "
        f"{tokens / wall:.1f} tok/s")  # fmt: skip
    return {
        "system": system, "label": LABELS[system], "requests": wl.num_requests,
        "prompt_tokens": wl.num_prompt_tokens, "output_tokens": tokens, "wall_s": wall,
        "tok_per_s": tokens / wall, "outputs": [o[:w] for o, w in zip(outputs, wl.output_lens)],
        **extra,
    }  # fmt: skip


# ---- systems ----------------------------------------------------------------------------------


def _dispatcher_installed() -> bool:
    try:
        from hf_paged.integration.dispatch import is_installed
    except Exception:  # noqa: BLE001 - no dispatcher: plain stock generate
        return False
    return is_installed()


def _generate_batches(model, wl: Workload, batch_size: int, device, **kwargs) -> list[list[int]]:
    """``wl`` through ``model.generate`` in left-padded batches with per-row stopping."""
    if "backend" not in kwargs and _dispatcher_installed():
        kwargs["backend"] = "hf"  # stock rows stay stock whatever HF_PAGED_BACKEND says
    outputs = []
    for start in range(0, wl.num_requests, batch_size):
        prompts = wl.prompts[start : start + batch_size]
        lens = wl.output_lens[start : start + batch_size]
        ids, mask = left_pad(prompts, device)
        crit = PerRowLength(ids.shape[1], lens, device)
        seqs = model.generate(
            ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
            pad_token_id=0, stopping_criteria=StoppingCriteriaList([crit]), **kwargs,
        )  # fmt: skip
        new = seqs[:, ids.shape[1] :].tolist()
        outputs += [row[:n] for row, n in zip(new, lens)]
        log(f"  batch {start // batch_size}: {len(prompts)} rows, width {ids.shape[1]}, "
            f"{max(lens)} steps done")  # fmt: skip
    return outputs


def run_stock(model, wl: Workload, batch_size: int, device) -> dict:
    warm = Workload("warmup", wl.arch, [[1, 2, 3, 4], [5, 6]], [4, 2])
    _generate_batches(model, warm, 2, device)
    sync(device)
    t0 = time.perf_counter()
    outputs = _generate_batches(model, wl, batch_size, device)
    sync(device)
    return _result("stock", wl, time.perf_counter() - t0, outputs, batch_size=batch_size)


def run_cb(model, wl: Workload, device) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in wl.prompts),
        max_generated_length=max(wl.output_lens),
        num_requests=wl.num_requests,
    )
    model.set_attn_implementation("paged|sdpa")
    try:
        t_start = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=30, workload_hints=hints
        ) as manager:  # its warm-up (CUDA graphs) runs before this block: not timed
            startup = time.perf_counter() - t_start
            log(f"cb: manager ready in {startup:.1f} s")
            sync(device)
            t0 = time.perf_counter()
            rids = [
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))
            ]
            results, last_log = {}, t0
            while len(results) < len(rids):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers CB: generation thread died")
                elif r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"transformers CB: request {r.request_id}: {r.error}")
                    results[r.request_id] = r
                if time.perf_counter() - last_log > 15:
                    last_log = time.perf_counter()
                    log(f"  cb: {len(results)}/{len(rids)} requests done")
            sync(device)
            wall = time.perf_counter() - t0
    finally:
        model.set_attn_implementation("sdpa")
    outputs = [list(results[r].generated_tokens) for r in rids]
    return _result("cb", wl, wall, outputs, startup_s=startup,
                   cb_config=str(getattr(manager, "continuous_batching_config", None)))  # fmt: skip


def run_llm(source, wl: Workload, engine_kwargs: dict, device, system: str = "llm") -> dict:
    """``wl`` through ``hf_paged.LLM(source)``: ``source`` is the HF model or, at
    tensor_parallel_size > 1, a checkpoint directory of it (``workloads.engine_source``)."""
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    t_start = time.perf_counter()
    llm = LLM(source, **engine_kwargs)
    startup = time.perf_counter() - t_start
    log(f"{system}: engine ready in {startup:.1f} s ({llm.stats['num_kv_blocks']} KV blocks)")
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([[1, 2, 3, 4], [5, 6]], warm, use_tqdm=False)
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens
        ]
        stats0 = llm.stats
        sync(device)
        t0 = time.perf_counter()
        with TritonCompileLog() as compiles:
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            sync(device)
        wall = time.perf_counter() - t0
        stats = llm.stats
        info = {
            "startup_s": startup,
            "engine_config": dataclasses.asdict(llm.engine.config),
            "num_kv_blocks": stats["num_kv_blocks"],
            "num_preemptions": stats["num_preemptions"] - stats0["num_preemptions"],
            "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"]
            - stats0["prefix_cache_hit_tokens"],
            "profile": stats.get("profile"),  # HF_PAGED_PROFILE=1: host/GPU split per step
            "triton_compiles_in_run": compiles.summary(),
            "attention_backend": type(
                getattr(getattr(llm.engine.executor, "runner", None), "attn_backend", None)
            ).__name__,
        }
    finally:
        llm.close()
        del llm
        free_memory(device)
    tc = info["triton_compiles_in_run"]
    log(f"{system}: {tc['count']} Triton compiles in the timed run ({tc['total_s']:.2f} s)")
    for line in tc["kernels"]:
        log(f"  compiled: {line}")
    if info["profile"]:
        for name, row in info["profile"].items():
            log(
                f"{system} profile {name:>15}: {row['total_s']:7.3f} s, {row['mean_ms']:7.3f} ms x {row['calls']}"
            )
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    row = _result(system, wl, wall, outputs, **info)
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        row["label"] += f" tp={engine_kwargs['tensor_parallel_size']}"
    return row


def run_dispatch(model, wl: Workload, batch_size: int, device, engine_kwargs: dict) -> dict:
    try:
        from hf_paged import PagedFallbackWarning, install, release
    except Exception as e:  # noqa: BLE001 - the row is optional
        log(f"dispatch: skipped, the dispatcher does not import: {e!r}")
        return {"system": "dispatch", "label": LABELS["dispatch"], "skipped": repr(e)}
    install()
    kwargs = {"backend": "paged", "paged_config": engine_kwargs}
    free_memory(device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            t_start = time.perf_counter()
            warm = Workload("warmup", wl.arch, [[1, 2, 3, 4], [5, 6]], [4, 2])
            _generate_batches(model, warm, 2, device, **kwargs)  # builds the engine
            log(f"dispatch: engine ready + warm-up in {time.perf_counter() - t_start:.1f} s")
            sync(device)
            t0 = time.perf_counter()
            outputs = _generate_batches(model, wl, batch_size, device, **kwargs)
            sync(device)
            wall = time.perf_counter() - t0
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
    finally:
        release(model)
        free_memory(device)
    if fallbacks:
        log(f"dispatch: FELL BACK to stock generate: {fallbacks}")
    return _result("dispatch", wl, wall, outputs, batch_size=batch_size,
                   fell_back_to_stock=fallbacks)  # fmt: skip


# ---- agreement / report -------------------------------------------------------------------------


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy-token agreement of ``other`` with ``reference`` (same requests, same lengths)."""
    prefixes, equal, total = [], 0, 0
    for ref, oth in zip(reference, other):
        n = 0
        while n < len(ref) and n < len(oth) and ref[n] == oth[n]:
            n += 1
        prefixes.append(n)
        equal += sum(a == b for a, b in zip(ref, oth))
        total += len(ref)
    return {
        "requests": len(prefixes),
        "prefix_agreement_rate": sum(prefixes) / total,  # positions before the first divergence
        "mean_exact_prefix_len": sum(prefixes) / len(prefixes),
        "mean_output_len": total / len(prefixes),
        "exact_match_requests": sum(p == len(r) for p, r in zip(prefixes, reference)),
        "position_agreement_rate": equal / total,  # all positions, after divergence too
    }


def check_agreement(model, wl, results, k, batch_size, device) -> dict:
    by = {r["system"]: r for r in results if "outputs" in r}
    if "stock" in by and by["stock"]["requests"] >= k:
        ref = by["stock"]["outputs"][:k]
    else:  # untimed stock run on the first k requests
        log(f"agreement: stock generate on the first {k} requests (untimed)")
        ref = _generate_batches(model, wl.head(k), batch_size, device)
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
