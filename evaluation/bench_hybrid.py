"""Qwen3.5 shape (issue 32, acceptance 3): ``LLM`` against stock ``generate`` on W1's requests.

transformers' default ``Qwen3_5TextConfig`` (hidden 4096, 32 layers, three of every four Gated
DeltaNet, vocab 248k), random bf16 weights (``random_models.build_random_model``'s init). Stock runs
the first ``--baseline-requests`` in padded batches of ``--batch-size``; ``LLM`` runs
``--our-requests`` (the recurrent layers on hf_paged's torch mixers, decode in CUDA graphs).
The JSON records which kernels stock's path used (fla / causal-conv1d installed or the torch
fallbacks), whether decode CUDA graphs were captured, the state pool's size, and the ratio.
Target: ``LLM`` >= 20x stock tokens/s. Results: evaluation/results/hybrid_<UTC>.json.

Usage (GPU, < 8 min): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_hybrid.py
Smoke (CPU): PYTHONPATH=. python evaluation/bench_hybrid.py --smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, sync
from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.benchmarks.runners import run_stock  # noqa: E402
from hf_paged.benchmarks.workloads import get_workload

_SMOKE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=128, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, vocab_size=10000)  # fmt: skip


def build(device, dtype, smoke: bool):
    """The Qwen3.5-shaped causal LM with random weights (N(0, 0.02) matrices, 1-D weights 1)."""
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(eos_token_id=None, pad_token_id=0, **(_SMOKE if smoke else {}))
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    model.eval()
    model.generation_config = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0)
    return model, cfg


def stock_kernels() -> dict:
    """What transformers' Gated DeltaNet ran on: the hub packages if installed, else its torch
    fallbacks (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``)."""
    have = {m: importlib.util.find_spec(m) is not None for m in ("fla", "causal_conv1d")}
    return {
        "fla_installed": have["fla"],
        "causal_conv1d_installed": have["causal_conv1d"],
        "delta_rule": "fla"
        if have["fla"]
        else "transformers torch_chunk/recurrent_gated_delta_rule",
        "conv": "causal_conv1d" if have["causal_conv1d"] else "transformers torch causal_conv1d",
    }


def run_llm(model, wl, device) -> dict:
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    t0 = time.perf_counter()
    llm = LLM(model)
    startup = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([[1, 2, 3, 4], [5, 6]], warm, use_tqdm=False)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in wl.output_lens]  # fmt: skip
        sync(device)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False)
        sync(device)
        wall = time.perf_counter() - t0
        stats = llm.stats
    finally:
        llm.close()
    n_out = sum(len(o.token_ids) for o in outs)
    assert n_out == wl.num_output_tokens, (n_out, wl.num_output_tokens)
    return {
        "system": "llm", "requests": wl.num_requests, "wall_s": wall, "output_tokens": n_out,
        "tok_per_s": n_out / wall, "startup_s": startup,
        "decode_cuda_graphs": runner.graph_runner is not None if runner else None,
        "cuda_graph_reason": getattr(runner, "cuda_graph_reason", None),
        "num_kv_blocks": stats["num_kv_blocks"], "num_preemptions": stats["num_preemptions"],
        "num_state_slots": stats["num_state_slots"], "state_slot_bytes": stats["state_slot_bytes"],
        "state_pool_bytes": stats["state_pool_bytes"],
        "outputs": [o.token_ids for o in outs],
    }  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--our-requests", type=int, default=256)
    p.add_argument("--baseline-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64, help="stock's padded batch")
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny widths, 8 short requests")
    args = p.parse_args(argv)
    if args.smoke:
        args.device = "cpu"
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    model, cfg = build(device, dtype, args.smoke)
    wl = get_workload("W1", smoke=args.smoke)
    log(f"Qwen3.5 shape: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers "
        f"({cfg.layer_types.count('linear_attention')} Gated DeltaNet), vocab {cfg.vocab_size}")  # fmt: skip
    ours = run_llm(model, wl.head(args.our_requests), device)
    log(f"llm: {ours['tok_per_s']:.0f} tok/s, decode graphs {ours['decode_cuda_graphs']}")
    stock = run_stock(model, wl.head(args.baseline_requests), args.batch_size, device)
    log(f"stock: {stock['tok_per_s']:.0f} tok/s")
    n = min(len(stock["outputs"]), len(ours["outputs"]))
    agree = sum(a == b for a, b in zip(stock["outputs"][:n], ours["outputs"][:n]))
    result = {
        "arch": "qwen3_5_text default" + (" (smoke widths)" if args.smoke else ""),
        "llm": {k: v for k, v in ours.items() if k != "outputs"},
        "stock": {k: v for k, v in stock.items() if k != "outputs"},
        "ratio": ours["tok_per_s"] / stock["tok_per_s"],
        "greedy_rows_identical_to_stock": f"{agree}/{n} (bf16; stock rows are left-padded)",
        "stock_kernels": stock_kernels(),
        "environment": environment(),
    }
    log(f"ratio {result['ratio']:.1f}x; rows identical {agree}/{n}")
    path = write_record(result, os.environ.get("OUT") or RESULTS_DIR, "hybrid")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
