"""Single-stream decode latency, L1 (evaluation/README.md, "Workloads"), every system in one process.

Llama-3-8B architecture (random bf16 weights), one 512-token prompt, 256 new tokens, greedy,
batch 1. For each system: time to first token (TTFT), decode ms/token = (total - TTFT) / 255,
and total / 256.

* ``dynamic``: stock ``generate`` (sdpa, DynamicCache, eager).
* ``static``: stock ``generate(cache_implementation="static")``. On CUDA transformers then
  compiles the decode forward by itself (``_valid_auto_compile_criteria``: a compileable,
  non-dynamic cache on a CUDA model and ``disable_compile`` unset; default ``CompileConfig`` =
  inductor, ``reduce-overhead``). Warmed up ``--static-warmups`` times (default 2) with the same
  shapes before timing; the result records whether ``model._compiled_call`` exists.
* ``llm``: ``hf_paged.LLM(model)`` (decode CUDA graphs on unless ``--enforce-eager``), stepped
  through its engine so TTFT is the end of the step that produced token 1. ``--repeats``
  (default 3) timed generations of distinct prompts; the row is the median one, all are listed.
  With ``--tensor-parallel-size N`` > 1 the engine gets a safetensors checkpoint of the model
  saved to a temp dir (each rank loads its shard from it); the stock rows keep the in-memory model.
* ``dispatch``: ``generate(backend="paged")`` on the native path: total / 256 only (a timing
  stopping criterion would move it to the external-sampling path). Skipped at
  ``--tensor-parallel-size`` > 1: the dispatcher serves an in-memory model, which only tp=1 can.

Stock TTFT/per-step times come from a StoppingCriteria that synchronizes the device and stamps the
time at every step (stock already synchronizes once per step to check for stopping).

Floor: weight bytes / device-to-device copy bandwidth, both measured in this run (copy of a
``--copy-gib`` GiB buffer, bandwidth = 2 x size / time, as in bench_kernels.py).

Usage (GPU): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_latency.py
Smoke (CPU): PYTHONPATH=. .venv/bin/python evaluation/bench_latency.py --smoke
TP (GPU): add ``--tensor-parallel-size 2``; on CPU ``--smoke --tensor-parallel-size 2`` (gloo).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_paged.benchmarks.device_memory import free_memory, mem_str, sync
from hf_paged.benchmarks.random_models import build_random_model, engine_source, weight_bytes
from hf_paged.benchmarks.run_record import environment, log, markdown_table
from hf_paged.benchmarks.workloads import make_requests
from hf_paged.engine.core.request import EngineRequest  # noqa: E402

SYSTEMS = ("llm", "dispatch", "dynamic", "static")
LABELS = {
    "dynamic": "HF generate (sdpa, dynamic cache)",
    "static": "HF generate (static cache, auto-compiled)",
    "llm": "hf_paged LLM (CUDA graphs)",
    "dispatch": 'hf_paged generate(backend="paged")',
}


class StepTimer(StoppingCriteria):
    """Never stops; records the time each new token is on the device (one call per token)."""

    def __init__(self, device):
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def copy_bandwidth(device, gib: float, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted), median of ``reps``."""
    n = int(gib * 2**30)
    x = torch.empty(n, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(reps):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        times.append(time.perf_counter() - t)
    del x, y
    free_memory(device)
    return 2 * n / statistics.median(times)


def _row(system: str, t0: float, token_times: list[float], t_end: float, n_new: int, **extra):
    """Latency numbers from the times at which tokens 1..n were ready (None: total only)."""
    row = {"system": system, "label": LABELS[system], "new_tokens": n_new,
           "total_s": t_end - t0, "total_ms_per_token": (t_end - t0) / n_new * 1e3, **extra}  # fmt: skip
    if token_times:
        ttft = token_times[0] - t0
        row["ttft_ms"] = ttft * 1e3
        row["decode_ms_per_token"] = (token_times[-1] - token_times[0]) / (n_new - 1) * 1e3
    log(f"{system}: " + ", ".join(f"{k}={v:.2f}" for k, v in row.items()
                                  if isinstance(v, float)))  # fmt: skip
    return row


def _dispatcher_installed() -> bool:
    try:
        from hf_paged.integration.dispatch import is_installed
    except Exception:  # noqa: BLE001 - no dispatcher: plain stock generate
        return False
    return is_installed()


def run_stock(model, prompt, warm_prompt, n_new, device, static: bool, warmups: int) -> dict:
    system = "static" if static else "dynamic"
    extra = {"cache_implementation": "static"} if static else {}

    kw = {"backend": "hf"} if _dispatcher_installed() else {}  # stay stock whatever the env says

    def call(ids, timer=None, new=n_new):
        crit = StoppingCriteriaList([timer]) if timer is not None else None
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
            pad_token_id=0, stopping_criteria=crit, **extra, **kw,
        )  # fmt: skip

    warm = torch.tensor([warm_prompt], device=device)
    # static: the same shapes as the timed call (the cache is sized by max_length), so the timed
    # call neither recompiles nor re-records graphs; dynamic has nothing to compile: 8 tokens do
    warm_new = n_new if static else min(n_new, 8)
    for i in range(warmups):
        t = time.perf_counter()
        call(warm, StepTimer(device), warm_new)
        log(f"{system}: warm-up {i + 1}/{warmups} took {time.perf_counter() - t:.1f} s")
    ids = torch.tensor([prompt], device=device)
    timer = StepTimer(device)
    sync(device)
    t0 = time.perf_counter()
    out = call(ids, timer)
    sync(device)
    t_end = time.perf_counter()
    n = out.shape[1] - ids.shape[1]
    assert n == n_new == len(timer.times), (n, n_new, len(timer.times))
    row = _row(system, t0, timer.times, t_end, n_new, tokens=out[0, ids.shape[1] :].tolist())
    if static:
        row["compiled"] = hasattr(model, "_compiled_call")
        if not row["compiled"]:
            row["label"] = "HF generate (static cache, NOT compiled)"
            log("static: transformers did not compile the forward (CPU, or criteria unmet)")
    return row


def run_llm(source, prompts, warm_prompt, n_new, device, ekw: dict) -> dict:
    """One timed generation per prompt (distinct prompts: no prefix hits); the row is the
    repeat with the median decode ms/token, with every repeat listed. Tokens: the first
    prompt's (the one stock runs). ``source``: the HF model, or at tensor_parallel_size > 1 a
    checkpoint directory of it (``random_models.engine_source``)."""
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    t = time.perf_counter()
    llm = LLM(source, **ekw)
    startup = time.perf_counter() - t
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    try:
        llm.generate([warm_prompt], params, use_tqdm=False)  # a different prompt: no prefix hit
        engine = llm.engine
        runs = []
        for prompt in prompts:
            rid = engine.add_request(EngineRequest(prompt, params))
            times, done = [], None
            sync(device)
            t0 = time.perf_counter()
            while done is None:
                res = engine.step()  # returns once the step's tokens are on the host
                times.append(time.perf_counter())
                done = next((o for o in res.finished if o.request_id == rid), None)
            n = len(done.outputs[0].token_ids)
            assert n == n_new, (n, n_new)
            # every step after the one that made token 1 makes one token (prefill may be chunked)
            runs.append((t0, times[len(times) - n :], times[-1], len(times),
                         list(done.outputs[0].token_ids)))  # fmt: skip
        decode = [(r[1][-1] - r[1][0]) / (n_new - 1) * 1e3 for r in runs]
        mid = sorted(range(len(runs)), key=decode.__getitem__)[len(runs) // 2]
        t0, token_times, t_end, steps, _ = runs[mid]
        row = _row("llm", t0, token_times, t_end, n_new, startup_s=startup, steps=steps,
                   engine_config=dataclasses.asdict(engine.config), tokens=runs[0][4],
                   repeats_decode_ms_per_token=decode,
                   repeats_ttft_ms=[(r[1][0] - r[0]) * 1e3 for r in runs])  # fmt: skip
        log(f"llm: decode ms/token of the {len(runs)} repeats: "
            + ", ".join(f"{d:.3f}" for d in decode) + " (row = median)")  # fmt: skip
        if device == "cpu" or ekw.get("enforce_eager"):
            row["label"] = "hf_paged LLM (eager)"
        if ekw.get("tensor_parallel_size", 1) > 1:
            row["label"] += f" tp={ekw['tensor_parallel_size']}"
        return row
    finally:
        llm.close()
        del llm
        free_memory(device)


def run_dispatch(model, prompt, warm_prompt, n_new, device, ekw: dict) -> dict:
    try:
        from hf_paged.integration import install, release
    except Exception as e:  # noqa: BLE001 - the row is optional
        log(f"dispatch: skipped, the dispatcher does not import: {e!r}")
        return {"system": "dispatch", "label": LABELS["dispatch"], "skipped": repr(e)}
    install()
    free_memory(device)
    kw = dict(max_new_tokens=n_new, do_sample=False, pad_token_id=0, backend="paged",
              paged_config=ekw)  # fmt: skip
    try:
        model.generate(torch.tensor([warm_prompt], device=device), **kw)  # builds the engine
        ids = torch.tensor([prompt], device=device)
        sync(device)
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        sync(device)
        t_end = time.perf_counter()
    finally:
        release(model)
        free_memory(device)
    assert out.shape[1] - ids.shape[1] == n_new
    return _row("dispatch", t0, [], t_end, n_new, tokens=out[0, ids.shape[1] :].tolist())


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama3-8b", choices=["llama3-8b", "qwen3-0.6b", "tiny"])
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--skip-dynamic", action="store_true", help="drop stock dynamic (~15 s)")
    p.add_argument("--static-warmups", type=int, default=2)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed llm generations (the median is reported)"
    )
    p.add_argument("--copy-gib", type=float, default=2.0, help="copy-bandwidth buffer size")
    p.add_argument("--device", default="cuda")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument(
        "--sync-scheduling",
        action="store_true",
        help="async_scheduling=False (default: the engine's auto, on for one CUDA rank)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="ranks of the hf_paged LLM row (N > 1: the engine loads a checkpoint saved to a "
        "temp dir; the stock rows keep the in-memory model)",
    )
    p.add_argument("--tmp-dir", default=None, help="where the tp > 1 checkpoint is saved")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny model, 32 + 8 tokens")
    args = p.parse_args(argv)
    if args.tensor_parallel_size < 1:
        p.error(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    tp = args.tensor_parallel_size
    if args.smoke:
        args.arch, args.device, args.prompt_len, args.new_tokens = "tiny", "cpu", 32, 8
        args.copy_gib, args.max_model_len = 1 / 16, None
        args.out_dir = args.out_dir or "/tmp/hf_paged_bench_smoke"
    systems = [s for s in args.systems if not (s == "dynamic" and args.skip_dynamic)]
    device = args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16
    vocab = 500 if args.smoke else 10000
    (prompt,), _ = make_requests(1, (args.prompt_len,) * 2, (1, 1), vocab, seed=0)
    (warm_prompt,), _ = make_requests(1, (args.prompt_len,) * 2, (1, 1), vocab, seed=1)
    if args.repeats < 1:
        p.error(f"--repeats must be >= 1, got {args.repeats}")
    llm_prompts = [prompt] + [
        make_requests(1, (args.prompt_len,) * 2, (1, 1), vocab, seed=2 + i)[0][0]
        for i in range(args.repeats - 1)
    ]
    ekw = {"max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
           "enforce_eager": args.enforce_eager,
           "async_scheduling": (False if args.sync_scheduling else None)}  # fmt: skip
    ekw = {k: v for k, v in ekw.items() if v is not None}

    log(f"L1: {args.arch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, {systems}")
    bw = copy_bandwidth(device, args.copy_gib)
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    t = time.perf_counter()
    model = build_random_model(args.arch, device, dtype)
    sync(device)
    wbytes = weight_bytes(model)
    floor_ms = wbytes / bw * 1e3
    log(f"model built in {time.perf_counter() - t:.1f} s; {wbytes / 1e9:.2f} GB of weights -> "
        f"floor {floor_ms:.2f} ms/token")  # fmt: skip

    rows = []
    for s in systems:  # ours first: the compiled static path keeps its graph pools afterwards
        log(f"{s}: start ({mem_str(device)})")
        if s == "llm":
            with engine_source(model, tp, args.tmp_dir) as (source, extra):
                rows.append(
                    run_llm(source, llm_prompts, warm_prompt, args.new_tokens, device,
                            {**ekw, **extra})
                )  # fmt: skip
        elif s == "dispatch" and tp > 1:
            why = "tensor_parallel_size > 1: generate(backend='paged') serves the in-memory model"
            log(f"dispatch: skipped ({why})")
            rows.append({"system": "dispatch", "label": LABELS["dispatch"], "skipped": why})
        elif s == "dispatch":
            rows.append(run_dispatch(model, prompt, warm_prompt, args.new_tokens, device, ekw))
        else:
            static = s == "static"
            warmups = args.static_warmups if static else 1
            rows.append(
                run_stock(model, prompt, warm_prompt, args.new_tokens, device, static, warmups)
            )
        free_memory(device)

    for r in rows:
        if "total_ms_per_token" in r:
            r["total_vs_floor"] = r["total_ms_per_token"] / floor_ms
            if "decode_ms_per_token" in r:
                r["decode_vs_floor"] = r["decode_ms_per_token"] / floor_ms
    # greedy agreement with stock: a fused kernel that computed the wrong thing diverges at once
    ref = next((r for r in rows if r["system"] in ("dynamic", "static") and "tokens" in r), None)
    for r in rows:
        if ref is not None and r is not ref and "tokens" in r:
            same = [a == b for a, b in zip(r["tokens"], ref["tokens"])]
            r["agreement_vs_" + ref["system"]] = {
                "exact_prefix": next((i for i, ok in enumerate(same) if not ok), len(same)),
                "position_rate": sum(same) / max(len(same), 1),
            }
            log(f"{r['system']} vs {ref['system']}: {r['agreement_vs_' + ref['system']]}")
    fmt = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    table = markdown_table(
        ["system", "TTFT ms", f"decode ms/token (/{args.new_tokens - 1})",
         f"total ms/token (/{args.new_tokens})", "decode / floor"],
        [[r["label"], fmt(r, "ttft_ms"), fmt(r, "decode_ms_per_token"),
          fmt(r, "total_ms_per_token") if "skipped" not in r else f"skipped: {r['skipped']}",
          f"{r['decode_vs_floor']:.2f}x" if "decode_vs_floor" in r else "-"] for r in rows]
        + [["floor: weight bytes / copy bandwidth", "-", f"{floor_ms:.2f}", f"{floor_ms:.2f}",
            "1.00x"]],
    )  # fmt: skip
    env = environment()
    print(f"\n### L1 ({args.arch}) on {env['gpu'] or 'cpu'}\n\n{table}\n", flush=True)
    out_dir = Path(args.out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"latency_{env['date_utc']}.json"
    doc = {
        "benchmark": "latency", "workload": "L1", "arch": args.arch, "smoke": args.smoke,
        "env": env, "dtype": str(dtype), "device": device, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "weight_bytes": wbytes, "copy_GBps": bw / 1e9,
        "copy_gib": args.copy_gib, "floor_ms_per_token": floor_ms, "engine_kwargs": ekw,
        "tensor_parallel_size": tp,
        "systems": rows, "table_markdown": table,
    }  # fmt: skip
    path.write_text(json.dumps(doc, indent=1, default=str))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
