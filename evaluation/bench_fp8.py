"""FP8 checkpoints and the fp8 KV cache on one GPU (issue 24's acceptance figures), one command.

Builds the Llama-3-8B architecture with random bf16 weights (``random_models.build_random_model``),
saves it, quantizes it with transformers' own ``FineGrainedFP8Config`` (128 x 128 blocks) while
loading it back, saves that FP8 checkpoint and the same weights as compressed-tensors
FP8-dynamic (``fp8_checkpoints.save_compressed_tensors_fp8``), then measures (``--parts``):

* ``w2``: W2 through ``LLM(<fine-grained FP8 dir>)`` and on the bf16 model of the same weights,
  alternating, each the median of ``--repeats``; with ``--stock-requests N`` also stock HF
  ``generate`` on transformers' FP8 model on the first N requests (throughput, and greedy
  agreement with ours on them).
* ``l1``: single-stream decode ms/token (512-token prompt, 256 new), FP8 and bf16, each the
  median of ``--repeats``.
* ``logits``: next-token logits of ``generate(backend="paged", output_logits=True)`` on the
  in-memory FP8 model against the W8A8 reference over 64 prompts: mean / min cosine. The
  reference is transformers' dequantized model (``FineGrainedFP8Config(dequantize=True)``) with
  every linear's input fake-quantized per token and 128-column group as our GEMMs quantize it
  (``layers/quantization/w8a8_reference.fake_quant_activations``). The cosine against the same
  model without the fake quantization (weight-only, W8A16) is recorded beside it.
* ``ct``: W2 through ``LLM(<compressed-tensors dir>)`` (median of ``--repeats``).
* ``kv``: W1 (Qwen3-0.6B, bf16) and W2 (FP8 weights) with ``kv_cache_dtype="fp8"`` against
  "auto": tok/s, KV capacity in tokens (blocks x block size), greedy agreement over the W1
  requests.

Results: ${OUT:-evaluation/results}/fp8_<UTC>.json (token lists dropped), written after every
part. The GEMM paths per shape: ``evaluation/bench_fp8_gemm.py``.

Usage (GPU; each call under ~9 min, checkpoints written first, ~2 min):
    PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_fp8.py --parts w2,l1,logits
    PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_fp8.py --parts ct,kv --repeats 2
Smoke (CPU, tiny model, 32 x 32 blocks): PYTHONPATH=. python evaluation/bench_fp8.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged import envs  # noqa: E402
from hf_paged.benchmarks.device_memory import free_memory
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import environment, log, utc_stamp
from hf_paged.benchmarks.runners import agreement, run_llm, run_stock  # noqa: E402
from hf_paged.benchmarks.workloads import Workload, get_workload
from hf_paged.engine.core.request import EngineRequest  # noqa: E402
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
            rid = engine.add_request(EngineRequest(prompt, params))
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


def w8a8_logits(fp8_model, fp8_dir: str, prompts, device, ekw: dict, group: int) -> dict:
    """Cosine of the next-token logits: ours (dispatcher on the in-memory FP8 model) against
    the W8A8 reference, and against the weight-only (W8A16) model (see the module docstring)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    import hf_paged
    from hf_paged.layers.quantization.w8a8_reference import fake_quant_activations

    hf_paged.install()
    ref = AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=fp8_model.dtype, device_map=str(device),
        quantization_config=FineGrainedFP8Config(dequantize=True),
    ).eval()  # fmt: skip
    ours, w8a16, w8a8 = [], [], []
    for p in prompts:
        ids = torch.tensor([p], device=device)
        kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1,
                  do_sample=False, pad_token_id=0, output_logits=True,
                  return_dict_in_generate=True)  # fmt: skip
        ours.append(
            fp8_model.generate(**kw, backend="paged", paged_config=ekw).logits[0][0].float()
        )
        with torch.no_grad():
            w8a16.append(ref(ids).logits[0, -1].float())
    hooked = fake_quant_activations(ref, group)
    with torch.no_grad():
        for p in prompts:
            w8a8.append(ref(torch.tensor([p], device=device)).logits[0, -1].float())
    del ref
    cos = torch.nn.functional.cosine_similarity

    def summary(theirs):
        c = [cos(a, b, dim=0).item() for a, b in zip(ours, theirs)]
        top = sum(int(a.argmax() == b.argmax()) for a, b in zip(ours, theirs))
        return {"mean_cosine": statistics.mean(c), "min_cosine": min(c), "argmax_equal": top}

    row = {"prompts": len(prompts), "hooked_linears": hooked,
           "reference": f"transformers dequantized + fake_quant_activations(group {group})",
           "vs_w8a8": summary(w8a8), "vs_w8a16": summary(w8a16)}  # fmt: skip
    log(f"logits: vs W8A8 {row['vs_w8a8']}, vs W8A16 {row['vs_w8a16']}")
    return row


def alternate_runs(fp8_src, bf16_src, wl: Workload, ekw: dict, device, repeats: int):
    """FP8 and bf16 W2 alternating (A/B/A/B...), so drift hits both; each the median row."""
    rows = {"fp8": [], "bf16": []}
    for _ in range(repeats):
        rows["fp8"].append(run_llm(fp8_src, wl, ekw, device, system="llm"))
        rows["bf16"].append(run_llm(bf16_src, wl, ekw, device, system="llm"))
    out = []
    for name, rs in rows.items():
        rates = [r["tok_per_s"] for r in rs]
        row = {**sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2], "system": f"llm_{name}",
               "repeats_tok_per_s": rates}  # fmt: skip
        log(f"llm_{name}: median {row['tok_per_s']:.0f} tok/s of {[round(r) for r in rates]}")
        out.append(row)
    return out[0], out[1]


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--stock-requests",
        type=int,
        default=0,
        help="also run stock generate on transformers' FP8 model on N requests",
    )
    ap.add_argument("--logit-prompts", type=int, default=64)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny model, 8 requests")
    ap.add_argument("--tmp-dir", default=None, help="where the checkpoints go (~35 GB for 8B)")
    args = ap.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS))
    if unknown:
        ap.error(f"--parts {unknown} are not allowed: choose from {list(PARTS)}")
    args.block = (32, 32) if args.smoke else (128, 128)
    device = torch.device("cpu" if args.smoke else "cuda")
    ekw = {"max_model_len": 2048} if not args.smoke else {"max_model_len": 256}
    out = {"env": environment(), "parts": args.parts, "block": args.block, "results": {},
           "fp8_gemm": envs.HF_PAGED_FP8_GEMM}  # fmt: skip
    res = out["results"]
    w2 = get_workload("W2", smoke=args.smoke)
    out_dir = Path(os.environ.get("OUT") or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fp8_{'smoke_' if args.smoke else ''}{utc_stamp()}.json"

    def save(part: str) -> None:  # after every part: a run stopped by a time limit keeps them
        path.write_text(json.dumps(out, indent=1, default=str))
        log(f"{part} done: wrote {path}")

    with tempfile.TemporaryDirectory(prefix="hf_paged_fp8_", dir=args.tmp_dir) as tmp:
        model, fp8_dir, ct_dir, fp8 = prepare(args, device, Path(tmp))
        if "w2" in args.parts:
            ours, bf16 = alternate_runs(fp8_dir, model, w2, ekw, device, args.repeats)
            res["w2"] = {"fp8": strip(ours), "bf16": strip(bf16),
                         "fp8_over_bf16": ours["tok_per_s"] / bf16["tok_per_s"]}  # fmt: skip
            log(f"w2: FP8 / bf16 = {res['w2']['fp8_over_bf16']:.2f}")
            if args.stock_requests:  # stock: transformers' FP8 model (its forward, or dequantized)
                ref, reference = hf_fp8_reference(fp8_dir, device, fp8.dtype)
                k = args.stock_requests
                stock = run_stock(ref, w2.head(k), k, device)
                stock["reference"] = reference
                res["w2"]["stock_fp8"] = strip(stock)
                res["w2"]["agreement_fp8_vs_stock_fp8"] = agreement(stock["outputs"],
                                                                    ours["outputs"][:k])  # fmt: skip
                del ref
                free_memory(device)
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
            res["logits"] = w8a8_logits(fp8, fp8_dir, prompts, device, ekw, args.block[1])
            save("logits")
            free_memory(device)
        if "ct" in args.parts:
            res["ct_w2"] = strip(median_run(ct_dir, w2, ekw, device, args.repeats, "llm_ct"))
            if "w2" in res:  # acceptance: within 10% of fine-grained FP8
                res["ct_over_finegrained"] = (
                    res["ct_w2"]["tok_per_s"] / res["w2"]["fp8"]["tok_per_s"]
                )
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
