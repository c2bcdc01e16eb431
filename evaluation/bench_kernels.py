"""Kernel microbenchmarks on one GPU: paged decode bandwidth, paged prefill FLOP rate, KV store.

Decode is memory-bound: bandwidth = bytes of K/V it must read (each visible key and value once)
over the median time, against the ~4.3 TB/s copy bandwidth measured on an H200 (re-measured here
as ``copy_GBps``). Prefill is compute-bound: causal FLOPs (4 * head_dim per visible q-k pair per
head) over time; the aten FlashAttention-2 varlen kernel is timed beside ours for pure prefill.

Usage: PYTHONPATH=. python3 evaluation/bench_kernels.py [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from pathlib import Path

import torch
import triton
import triton.testing

from hf_paged import envs
from hf_paged.kernels.attention.kv_store import store_kvcache
from hf_paged.kernels.attention.paged_decode import default_num_partitions, paged_decode
from hf_paged.kernels.attention.paged_prefill import paged_prefill

PEAK_GBPS = 4300.0  # H200 device-to-device copy, measured on the GPU machine (2026-11-30)
QWEN3_06B = dict(num_heads=16, num_kv_heads=8, head_dim=128)
LLAMA3_8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)
HEAD_DIM_64 = dict(num_heads=32, num_kv_heads=8, head_dim=64)  # Llama-3.2-1B-like


def _paged(seqs, num_heads, num_kv_heads, head_dim, block_size=16, seed=0):
    """Random bf16 paged batch; blocks shuffled over the cache like a long-running server's."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 16
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
    ids = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n]
        used += n
    cu = torch.tensor([0] + [q for q, _ in seqs], device="cuda").cumsum(0).int()
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen, device="cuda")
    return q.bfloat16(), k_cache, v_cache, block_tables, cu, ctx


def _time_ms(fn) -> float:
    """Device time per call: median over CUDA-graph replays (the engine replays decode graphs)."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def _time_eager_ms(fn) -> float:
    """Eager time per call, host launch overhead included when it is not hidden."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def bench_copy() -> dict:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB, read + write
    y = torch.empty_like(x)
    ms = _time_eager_ms(lambda: y.copy_(x))  # graph-replayed copy_ measured ~35% slower
    return {"name": "copy_1GiB", "ms": ms, "copy_GBps": 2 * x.numel() / ms / 1e6}


def bench_decode(
    name, batch, ctx_lo, ctx_hi, shape, config=None, num_partitions=None, eager=False
) -> dict:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(ctx_lo, ctx_hi + 1, (batch,), generator=gen).tolist()
    q, kc, vc, bt, _, ctx = _paged([(1, n) for n in lens], **shape)
    scale = shape["head_dim"] ** -0.5
    fn = lambda: paged_decode(q, kc, vc, bt, ctx, scale, num_partitions=num_partitions,  # noqa: E731
                              config=config)  # fmt: skip
    ms = _time_ms(fn)
    kv_bytes = 2 * sum(lens) * shape["num_kv_heads"] * shape["head_dim"] * kc.element_size()
    io_bytes = 2 * q.numel() * q.element_size() + bt.numel() * 4
    gbps = (kv_bytes + io_bytes) / ms / 1e6
    eager_ms = _time_eager_ms(fn) if eager else None
    parts = num_partitions or default_num_partitions(
        batch, shape["num_kv_heads"], bt.shape[1] * kc.shape[1], q.device
    )
    return {"name": name, "batch": batch, "mean_ctx": sum(lens) / batch, "ms": ms, "GBps": gbps,
            "frac_of_peak": gbps / PEAK_GBPS, "num_partitions": parts, "config": config,
            "eager_ms": eager_ms}  # fmt: skip


def _causal_flops(seqs, num_heads, head_dim, window=None) -> float:
    pairs = 0
    for q_len, ctx in seqs:
        for pos in range(ctx - q_len, ctx):
            pairs += min(pos + 1, window or pos + 1)
    return 4.0 * head_dim * num_heads * pairs


def bench_prefill(name, seqs, shape, config=None, flash=False) -> dict:
    q, kc, vc, bt, cu, ctx = _paged(seqs, **shape)
    scale = shape["head_dim"] ** -0.5
    max_q = max(q_len for q_len, _ in seqs)
    if flash:  # new tokens' K/V as contiguous varlen tensors (what the backend hands aten)
        num_tokens = q.shape[0]
        k = torch.randn(num_tokens, shape["num_kv_heads"], shape["head_dim"], device="cuda")
        k, v = k.bfloat16(), torch.randn_like(k).bfloat16()
        fn = lambda: torch.ops.aten._flash_attention_forward(  # noqa: E731
            q, k, v, cu, cu, max_q, max_q, 0.0, True, False, scale=scale
        )
    else:
        fn = lambda: paged_prefill(q, kc, vc, bt, cu, ctx, max_q, scale, config=config)  # noqa: E731
    ms = _time_ms(fn)
    tflops = _causal_flops(seqs, shape["num_heads"], shape["head_dim"]) / ms / 1e9
    return {"name": name, "num_tokens": q.shape[0], "ms": ms, "TFLOPs": tflops,
            "kernel": "aten_flash" if flash else "triton_paged", "config": config}  # fmt: skip


def bench_store(num_tokens=16384, num_kv_heads=8, head_dim=128) -> dict:
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    num_blocks = num_tokens // 16 + 64
    kc = torch.empty(num_blocks, 16, num_kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    vc = torch.empty_like(kc)
    slots = torch.randperm(num_blocks * 16, device="cuda")[:num_tokens]
    ms = _time_ms(lambda: store_kvcache(k, v, kc, vc, slots))
    gbps = 4 * k.numel() * k.element_size() / ms / 1e6  # k, v read + written
    return {"name": f"store_kvcache_{num_tokens}tok", "ms": ms, "GBps": gbps}


def _sweep(w1_prompts, chunks) -> list[dict]:
    """Tile / warp / stage / split choices around the defaults (device time via CUDA graphs)."""
    rows = []
    for shape, name in ((QWEN3_06B, "d128"), (HEAD_DIM_64, "d64")):
        for tile in (32, 64, 128):
            for warps in (2, 4):
                for stages in (2, 3, 4):
                    cfg = dict(TILE_N=tile, num_warps=warps, num_stages=stages)
                    rows.append(_try(bench_decode, f"sweep_decode_{name}_b256", 256, 550, 650,
                                     shape, cfg))  # fmt: skip
    for batch, lo, hi in ((8, 4000, 4096), (1, 16000, 16384), (32, 1000, 1200)):
        for parts in (4, 8, 16, 32, 64):
            rows.append(_try(bench_decode, f"sweep_decode_b{batch}_parts", batch, lo, hi,
                             QWEN3_06B, num_partitions=parts))  # fmt: skip
    for seqs, name in ((w1_prompts, "w1"), (chunks, "chunk")):
        for shape, dname in ((QWEN3_06B, "d128"), (HEAD_DIM_64, "d64")):
            for block_m in (64, 128):
                for tile in (32, 64):
                    for warps in (4, 8):
                        for stages in (2, 3):
                            cfg = dict(BLOCK_M=block_m, TILE_N=tile, num_warps=warps,
                                       num_stages=stages)  # fmt: skip
                            rows.append(_try(bench_prefill, f"sweep_prefill_{name}_{dname}", seqs,
                                             shape, cfg))  # fmt: skip
    return rows


def _try(fn, *args, **kwargs) -> dict:
    """Sweep points may not fit (shared memory, registers): record the error, keep going."""
    try:
        return fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001
        return {"name": args[0], "ms": float("nan"), "error": str(exc)[:200], **kwargs}


def _git_sha() -> str:
    if envs.HF_PAGED_GIT_SHA:  # a copied tree may carry a stale .git
        return envs.HF_PAGED_GIT_SHA
    try:
        cmd = ["git", "rev-parse", "HEAD"]
        return subprocess.check_output(cmd, text=True, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sweep", action="store_true", help="also sweep tile/warp/stage configs")
    parser.add_argument("--out", default=None, help="JSON path (default evaluation/results/)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    w1_prompts = [(n, n) for n in torch.randint(100, 1025, (64,), generator=gen).tolist()]
    chunks = [(512, 2048)] * 16  # chunked prefill over a 1536-token cached prefix

    rows = [bench_copy(), bench_store()]
    rows.append(bench_decode("decode_qwen3_b256_ctx600", 256, 550, 650, QWEN3_06B, eager=True))
    rows.append(bench_decode("decode_qwen3_b64_ctx2k", 64, 1800, 2200, QWEN3_06B))
    rows.append(bench_decode("decode_qwen3_b8_ctx4k", 8, 4000, 4096, QWEN3_06B))
    rows.append(bench_decode("decode_qwen3_b1_ctx16k", 1, 16000, 16384, QWEN3_06B))
    rows.append(bench_decode("decode_llama8b_b256_ctx600", 256, 550, 650, LLAMA3_8B))
    rows.append(bench_decode("decode_d64_b256_ctx600", 256, 550, 650, HEAD_DIM_64))
    rows.append(bench_prefill("prefill_w1_64prompts", w1_prompts, QWEN3_06B))
    rows.append(bench_prefill("prefill_w1_64prompts", w1_prompts, QWEN3_06B, flash=True))
    rows.append(bench_prefill("prefill_chunk512_over1536", chunks, QWEN3_06B))
    rows.append(bench_prefill("prefill_d64_w1_64prompts", w1_prompts, HEAD_DIM_64))
    if args.sweep:
        rows += _sweep(w1_prompts, chunks)

    report = {
        "date": datetime.date.today().isoformat(),
        "git_sha": _git_sha(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "hf_paged_envs": envs.snapshot(),
        "results": rows,
    }
    out = Path(args.out or f"evaluation/results/kernels_{report['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    for r in rows:
        keys = ("copy_GBps", "GBps", "frac_of_peak", "TFLOPs", "eager_ms", "num_partitions")
        metric = {k: round(r[k], 3) for k in keys if r.get(k) is not None}
        extra = r.get("config") or r.get("kernel") or r.get("error") or ""
        print(f"{r['name']:32s} {r['ms']:8.4f} ms  {metric}  {extra}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
