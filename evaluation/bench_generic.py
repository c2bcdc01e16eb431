"""The generic model path on the GPU (issue 12, acceptance 4), everything in one process.

* ``--check impl``: Llama-3-8B architecture, W2 through ``LLM`` with ``model_impl="native"`` and
  ``"generic"`` (same weights), plus L1 (one 512-token prompt, 256 new tokens) for both.
  Target: generic >= 0.9x native throughput, L1 <= 1.1x native.
* ``--check stock``: a Gemma2-2B-shaped model and a Qwen3-30B-A3B-shaped MoE (real widths,
  ``--layers`` layers) on W1 prompts: stock ``generate`` (first ``--baseline-requests``) vs
  ``LLM`` on the generic path (all requests). Target: >= 10x.

Random bf16 weights (``random_models.build_random_model``'s init). Results:
evaluation/results/generic_<check>_<UTC>.json.

Usage (GPU): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_generic.py --check impl
"""

from __future__ import annotations

import argparse
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, sync
from hf_paged.benchmarks.random_models import build_random_model, model_config
from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.benchmarks.runners import run_llm, run_stock  # noqa: E402
from hf_paged.benchmarks.workloads import get_workload

_SMOKE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              intermediate_size=128, moe_intermediate_size=32, num_experts=4,
              num_experts_per_tok=2, vocab_size=10000)  # fmt: skip


def shaped_config(arch: str, layers: int, smoke: bool = False):
    """Real widths of Gemma2-2B / Qwen3-30B-A3B with ``layers`` layers (``smoke``: tiny)."""
    from transformers import Gemma2Config, Qwen3MoeConfig

    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0, num_hidden_layers=layers)
    if smoke:
        cfg = shaped_config(arch, layers)
        for k, v in _SMOKE.items():
            if hasattr(cfg, k):
                setattr(cfg, k, v)
        return cfg
    if arch == "gemma2-2b":
        return Gemma2Config(
            hidden_size=2304, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
            intermediate_size=9216, vocab_size=256000, sliding_window=4096,
            query_pre_attn_scalar=256, attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0, max_position_embeddings=8192, **common,
        )  # fmt: skip
    if arch == "qwen3-30b-a3b":
        return Qwen3MoeConfig(
            hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
            intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, vocab_size=151936, max_position_embeddings=40960,
            tie_word_embeddings=False, **common,
        )  # fmt: skip
    return model_config(arch)


def build(arch: str, layers: int, device, smoke: bool = False):
    cfg = shaped_config(arch, layers, smoke)
    # stock's default attention: Gemma2 has no sdpa path (softcapping), so eager
    attn = "eager" if arch.startswith("gemma2") else "sdpa"
    return build_random_model(cfg, device=device, attn_implementation=attn)


def latency(model, impl: str, device, prompt_len: int = 512, new: int = 256) -> float:
    """ms per generated token of one request (prefill included), after a warm-up."""
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    llm = LLM(model, model_impl=impl, max_model_len=4096)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        prompt = [(7 * i) % 10000 for i in range(prompt_len)]
        llm.generate([prompt[:16]], params, use_tqdm=False)
        sync(device)
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        sync(device)
        ms = (time.perf_counter() - t0) / new * 1e3
        graphs = llm.engine.executor.runner.cuda_graph_reason
    finally:
        llm.close()
        free_memory(device)
    log(f"L1 {impl}: {ms:.2f} ms/token (cuda graphs: {graphs or 'captured'})")
    return ms


def check_impl(args, device) -> dict:
    model = build("llama3-8b", 32, device)
    wl = get_workload("W2").head(args.our_requests)
    rows = {impl: run_llm(model, wl, {"model_impl": impl}, device)
            for impl in ("native", "generic")}  # fmt: skip
    l1 = {impl: latency(model, impl, device) for impl in ("native", "generic")}
    tps = {k: r["tok_per_s"] for k, r in rows.items()}
    return {"throughput": rows, "l1_ms": l1,
            "w2_ratio": tps["generic"] / tps["native"], "l1_ratio": l1["generic"] / l1["native"]}  # fmt: skip


def check_stock(args, device) -> dict:
    out = {}
    for arch in args.archs:
        model = build(arch, args.layers, device, args.smoke)
        wl = get_workload("W1", smoke=args.smoke)
        model = model.float() if device.type == "cpu" else model
        stock = run_stock(model, wl.head(args.baseline_requests), 64, device)
        ours = run_llm(model, wl.head(args.our_requests), {"model_impl": "generic"}, device)
        out[arch] = {"stock": stock, "generic": ours,
                     "ratio": ours["tok_per_s"] / stock["tok_per_s"]}  # fmt: skip
        log(f"{arch}: generic {ours['tok_per_s']:.0f} tok/s vs stock "
            f"{stock['tok_per_s']:.0f} = {out[arch]['ratio']:.1f}x")  # fmt: skip
        del model
        free_memory(device)
    return out


def _without_outputs(obj):
    """``obj`` with every run's generated token lists left out (megabytes; the figures stay)."""
    if isinstance(obj, dict):
        return {k: _without_outputs(v) for k, v in obj.items() if k != "outputs"}
    return obj


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", choices=["impl", "stock"], required=True)
    p.add_argument("--layers", type=int, default=12, help="layers of the shaped models")
    p.add_argument("--archs", nargs="+", default=["gemma2-2b", "qwen3-30b-a3b"],
                   choices=["gemma2-2b", "qwen3-30b-a3b"], help="--check stock models")  # fmt: skip
    p.add_argument("--our-requests", type=int, default=256)
    p.add_argument("--baseline-requests", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny widths (--check stock only)")
    args = p.parse_args(argv)
    if args.smoke:
        args.device, args.layers = "cpu", 2
    device = torch.device(args.device)
    result = check_impl(args, device) if args.check == "impl" else check_stock(args, device)
    result["environment"] = environment()
    path = write_record(_without_outputs(result), RESULTS_DIR, f"generic_{args.check}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
