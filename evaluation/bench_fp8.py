"""FP8 checkpoints and the fp8 KV cache on one GPU (issue 24's acceptance figures), one command.

Builds the Llama-3-8B architecture with random bf16 weights (``workloads.build_random_model``),
saves it, quantizes it with transformers' own ``FineGrainedFP8Config`` (128 x 128 blocks) while
loading it back, saves that FP8 checkpoint and the same weights as compressed-tensors
FP8-dynamic (``fp8_checkpoints.save_compressed_tensors_fp8``), then measures (``--parts``):

* ``w2``: W2 through ``LLM(<fine-grained FP8 dir>)`` (median of ``--repeats``), beside W2 on
  the bf16 model in the same call, and stock HF ``generate`` on transformers' FP8 model (the
  reference of ``logits``) on the first ``--stock-requests`` requests (throughput, and greedy
  agreement with ours on them).
* ``l1``: single-stream decode ms/token (512-token prompt, 256 new), FP8 and bf16, each the
  median of ``--repeats``.
* ``logits``: next-token logits of ``generate(backend="paged", output_logits=True)`` on the
  in-memory FP8 model against the same call on stock (``backend="hf"``: transformers' own FP8
  forward) over 64 prompts: mean / min cosine. When transformers' FP8 forward cannot run (it
  needs its ``finegrained-fp8`` hub kernel or DeepGEMM, not reachable from the GPU machine) the
  reference is its dequantized model (``FineGrainedFP8Config(dequantize=True)``) and the row
  says so (``reference``).
* ``ct``: W2 through ``LLM(<compressed-tensors dir>)`` (median of ``--repeats``).
* ``kv``: W1 (Qwen3-0.6B, bf16) and W2 (FP8 weights) with ``kv_cache_dtype="fp8"`` against
  "auto": tok/s, KV capacity in tokens (blocks x block size), greedy agreement over the W1
  requests.

Results: evaluation/results/fp8_<UTC>.json (token lists dropped). ``--sweep`` times the block
GEMM's tile configs at 8B's shapes first (``kernels/fp8_gemm.py`` defaults are untuned).

Usage (GPU, one device call, ~8-10 min): PYTHONUNBUFFERED=1 PYTHONPATH=. python
evaluation/bench_fp8.py; split with ``--parts w2,l1,logits`` and ``--parts ct,kv``.
Smoke (CPU, tiny model, 32 x 32 blocks): PYTHONPATH=. python evaluation/bench_fp8.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hf_paged.benchmarks.runners import agreement, run_llm, run_stock  # noqa: E402
from hf_paged.benchmarks.workloads import (  # noqa: E402
    RESULTS_DIR,
    Workload,
    build_random_model,
    environment,
    free_memory,
    get_workload,
    log,
    sync,
    utc_stamp,
)
from hf_paged.layers.quantization.fp8_checkpoints import (  # noqa: E402
    load_finegrained_fp8,
    save_compressed_tensors_fp8,
)

PARTS = ("w2", "l1", "logits", "ct", "kv")


def median_run(source, wl: Workload, ekw: dict, device, repeats: int, system: str) -> dict:
    """``run_llm`` ``repeats`` times (fresh engine each); the median row, every figure listed."""
    rows = [run_llm(source, wl, ekw, device, system="llm") for _ in range(repeats)]
    rates = [r["tok_per_s"] for r in rows]
    row = sorted(rows, key=lambda r: r["tok_per_s"])[len(rows) // 2]
    row = {**row, "system": system, "repeats_tok_per_s": rates}
    log(f"{system}: median {row['tok_per_s']:.0f} tok/s of {[round(r) for r in rates]}")
    return row


def decode_latency(source, prompt_len: int, n_new: int, ekw: dict, device, repeats: int):
    """Median decode ms/token of ``repeats`` single-stream generations (distinct prompts)."""
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    llm = LLM(source, **ekw)
    try:
        llm.generate([[7] * 16], params, use_tqdm=False)  # warm-up, no prefix hit below
        per_token = []
        for r in range(repeats):
            prompt = [(31 * r + 17 * i) % 500 for i in range(prompt_len)]  # < every vocab
            engine, times = llm.engine, []
            rid = engine.add_request(prompt, params)
            done = None
            while done is None:
                res = engine.step()
                times.append(time.perf_counter())
                done = next((o for o in res.finished if o.request_id == rid), None)
            per_token.append((times[-1] - times[-n_new]) / (n_new - 1) * 1e3)
    finally:
        llm.close()
        free_memory(device)
    return {"ms_per_token": statistics.median(per_token), "repeats_ms_per_token": per_token}


def hf_fp8_reference(fp8_dir: str, device, dtype):
    """transformers' own FP8 model when its forward runs here, else its dequantized model."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    model = AutoModelForCausalLM.from_pretrained(fp8_dir, dtype=dtype, device_map=str(device))
    if not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):  # CPU: dequantized
        return model.eval(), "transformers dequantized (it dequantizes FP8 at load here)"
    try:
        with torch.no_grad():
            model(torch.tensor([[1, 2, 3]], device=device))
        return model.eval(), "transformers FP8 forward"
    except Exception as e:  # noqa: BLE001 - its kernels are a hub download
        log(f"logits: transformers' FP8 forward failed ({type(e).__name__}: {str(e)[:120]}); "
            "comparing against its dequantized model")  # fmt: skip
        del model
        free_memory(device)
    qc = FineGrainedFP8Config(dequantize=True)
    model = AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=dtype, device_map=str(device), quantization_config=qc
    )
    return model.eval(), "transformers dequantized (FP8 forward unavailable)"


def logits_cosine(fp8_model, ref, reference: str, prompts, device, ekw: dict) -> dict:
    """Cosine of the next-token logits: ours (dispatcher on the in-memory FP8 model) vs ``ref``."""
    import hf_paged

    hf_paged.install()
    cos = []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                  do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
        ours = fp8_model.generate(**kw, backend="paged", paged_config=ekw).logits[0][0].float()
        with torch.no_grad():
            theirs = ref(ids).logits[0, -1].float()
        cos.append(torch.nn.functional.cosine_similarity(ours, theirs, dim=0).item())
    log(f"logits vs {reference}: mean cosine {statistics.mean(cos):.5f}, min {min(cos):.5f}")
    return {"reference": reference, "prompts": len(prompts), "mean_cosine": statistics.mean(cos),
            "min_cosine": min(cos)}  # fmt: skip


def kv_capacity(row: dict) -> int:
    return row["num_kv_blocks"] * row["engine_config"]["kv_block_size"]


def strip(row: dict) -> dict:
    return {k: v for k, v in row.items() if k != "outputs"}


def prepare(args, device, root: Path):
    """(bf16 model, fine-grained FP8 dir, compressed-tensors dir, FP8 model in memory)."""
    arch = "tiny" if args.smoke else "llama3-8b"
    dtype = torch.float32 if args.smoke else torch.bfloat16
    t = time.perf_counter()
    model = build_random_model(arch, device=device, dtype=dtype)
    plain, fp8_dir, ct_dir = root / "plain", root / "fp8", root / "ct"
    model.save_pretrained(plain)
    fp8 = load_finegrained_fp8(plain, args.block, dtype=dtype, device=str(device))
    fp8.save_pretrained(fp8_dir)
    if "ct" in args.parts:
        save_compressed_tensors_fp8(model, ct_dir, "channel", dynamic=True)
    log(f"prepare: bf16 model, FP8 checkpoints written in {time.perf_counter() - t:.1f} s")
    return model, str(fp8_dir), str(ct_dir), fp8


def sweep_block_gemm(device) -> list[dict]:
    """Tile configs of the block GEMM at 8B shapes, microseconds per call (CUDA only)."""
    from hf_paged.kernels.fp8_gemm import w8a8_block_matmul
    from hf_paged.kernels.fp8_quant import per_token_group_quant

    rows = []
    configs = [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
               for bm in (16, 64) for bn in (32, 64, 128) for w in (4, 8) for s in (3, 4)]  # fmt: skip
    for n, k in ((6144, 4096), (28672, 4096), (4096, 14336), (4096, 4096)):
        w = torch.randn(n, k, device=device).to(torch.float8_e4m3fn)
        ws = torch.rand(n // 128, k // 128, device=device)
        for m in (1, 16, 256, 2048):
            x_q, x_s = per_token_group_quant(
                torch.randn(m, k, device=device, dtype=torch.bfloat16), 128
            )
            for cfg in configs:
                if cfg["BLOCK_M"] > max(16, m):
                    continue
                try:
                    args = (x_q, x_s, w, ws, (128, 128), torch.bfloat16)
                    w8a8_block_matmul(*args, config=cfg)  # compile
                    sync(device)
                    t = time.perf_counter()
                    for _ in range(20):
                        w8a8_block_matmul(*args, config=cfg)
                    sync(device)
                    us = (time.perf_counter() - t) / 20 * 1e6
                except Exception as e:  # noqa: BLE001 - a config that does not compile
                    us = None
                    log(f"sweep: {cfg} failed: {type(e).__name__}")
                rows.append({"n": n, "k": k, "m": m, **cfg, "us": us,
                             "tb_per_s": n * k / us / 1e6 if us else None})  # fmt: skip
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--stock-requests", type=int, default=16)
    ap.add_argument("--logit-prompts", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, 8 requests")
    ap.add_argument("--sweep", action="store_true", help="time block-GEMM tile configs first")
    ap.add_argument("--tmp-dir", default=None, help="where the checkpoints go (~35 GB for 8B)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts {unknown} are not allowed: choose from {list(PARTS)}")
    args.block = (32, 32) if args.smoke else (128, 128)
    device = torch.device("cpu" if args.smoke else "cuda")
    ekw = {"max_model_len": 2048} if not args.smoke else {"max_model_len": 256}
    out = {"env": environment(), "parts": args.parts, "block": args.block, "results": {}}
    res = out["results"]
    if args.sweep and device.type == "cuda":
        res["block_gemm_sweep"] = sweep_block_gemm(device)
    w2 = get_workload("W2", smoke=args.smoke)
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"fp8_{'smoke_' if args.smoke else ''}{utc_stamp()}.json"

    def save(part: str) -> None:  # after every part: a run stopped by a time limit keeps them
        path.write_text(json.dumps(out, indent=1, default=str))
        log(f"{part} done: wrote {path}")

    with tempfile.TemporaryDirectory(prefix="hf_paged_fp8_", dir=args.tmp_dir) as tmp:
        model, fp8_dir, ct_dir, fp8 = prepare(args, device, Path(tmp))
        ref = reference = None
        if "w2" in args.parts or "logits" in args.parts:  # stock: transformers' FP8 model
            ref, reference = hf_fp8_reference(fp8_dir, device, fp8.dtype)
            out["stock_reference"] = reference
        if "w2" in args.parts:
            ours = median_run(fp8_dir, w2, ekw, device, args.repeats, "llm_fp8")
            bf16 = median_run(model, w2, ekw, device, 1, "llm_bf16")
            stock = run_stock(ref, w2.head(args.stock_requests), args.stock_requests, device)
            stock["reference"] = reference
            k = args.stock_requests
            res["w2"] = {"fp8": strip(ours), "bf16": strip(bf16), "stock_fp8": strip(stock),
                         "agreement_fp8_vs_stock_fp8": agreement(stock["outputs"],
                                                                 ours["outputs"][:k])}  # fmt: skip
            save("w2")
        if "l1" in args.parts:
            n = 16 if args.smoke else 256
            plen = 32 if args.smoke else 512
            res["l1"] = {
                "fp8": decode_latency(fp8_dir, plen, n, ekw, device, args.repeats),
                "bf16": decode_latency(model, plen, n, ekw, device, args.repeats),
            }
            log(f"l1: {res['l1']}")
            save("l1")
        if "logits" in args.parts:
            prompts = w2.prompts[: args.logit_prompts]
            res["logits"] = logits_cosine(fp8, ref, reference, prompts, device, ekw)
            save("logits")
        del ref
        free_memory(device)
        if "ct" in args.parts:
            res["ct_w2"] = strip(median_run(ct_dir, w2, ekw, device, args.repeats, "llm_ct"))
            save("ct")
        if "kv" in args.parts:
            kv = {}
            w1 = get_workload("W1", smoke=args.smoke)
            small = build_random_model("tiny" if args.smoke else "qwen3-0.6b", device=device,
                                       dtype=model.dtype)  # fmt: skip
            for name, src, wl in (("w1", small, w1), ("w2", fp8_dir, w2)):
                auto = median_run(src, wl, ekw, device, args.repeats, f"{name}_kv_auto")
                f8 = median_run(src, wl, {**ekw, "kv_cache_dtype": "fp8"}, device, args.repeats,
                                f"{name}_kv_fp8")  # fmt: skip
                kv[name] = {"auto": strip(auto), "fp8": strip(f8),
                            "capacity_tokens": {"auto": kv_capacity(auto), "fp8": kv_capacity(f8)},
                            "agreement_fp8_vs_auto": agreement(auto["outputs"], f8["outputs"])}  # fmt: skip
                log(
                    f"kv {name}: {kv[name]['capacity_tokens']}, {kv[name]['agreement_fp8_vs_auto']}"
                )
            res["kv"] = kv
            save("kv")
    save("all")


if __name__ == "__main__":
    main()
