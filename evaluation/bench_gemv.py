"""Small-batch linear layers (decode at batch 1-16): cuBLAS (``F.linear``) vs our skinny GEMM.

For the Llama-3-8B decode shapes (qkv, o, gate_up, down, lm_head) and a few row counts, times
each in a CUDA graph (median of replays) and reports weight-read bandwidth = weight bytes / time.
``--sweep`` also tries tile configurations of the Triton kernel. Checks our output against
``F.linear`` (fp32 accumulate both; bf16 outputs may differ by an ulp from summation order).

Usage: PYTHONPATH=. python evaluation/bench_gemv.py [--sweep] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
import triton.testing

from hf_paged.benchmarks.run_record import environment, log
from hf_paged.kernels.skinny_gemm import _config, skinny_gemm  # noqa: E402

SHAPES_8B = {  # name: (N, K)
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SHAPES_06B = {"qkv": (4096, 1024), "o_proj": (1024, 2048), "gate_up": (6144, 1024),
              "down": (1024, 3072), "lm_head": (151936, 1024)}  # fmt: skip
SWEEP = [(bn, bk, w, s) for bn in (16, 32, 64) for bk in (128, 256, 512) for w in (4,)
         for s in (3, 4, 6)]  # fmt: skip


def _time_ms(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--arch", default="8b", choices=["8b", "0.6b"])
    p.add_argument("--out", default=None)
    args = p.parse_args()
    shapes = SHAPES_8B if args.arch == "8b" else SHAPES_06B
    results = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in shapes.items():
        w = (torch.randn(n, k, generator=gen, device="cuda") * 0.02).bfloat16()
        nbytes = w.numel() * w.element_size()
        for m in args.rows:
            x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
            ref = F.linear(x, w)
            row = {"shape": name, "N": n, "K": k, "M": m, "weight_MB": nbytes / 1e6}
            t = _time_ms(lambda x=x, w=w: F.linear(x, w))
            row["cublas_us"], row["cublas_GBps"] = 1e3 * t, nbytes / t / 1e6
            configs = SWEEP if args.sweep else [_config(n, k)]
            best = None
            for cfg in configs:
                try:
                    out = skinny_gemm(x, w, config=cfg)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = _time_ms(lambda x=x, w=w, cfg=cfg: skinny_gemm(x, w, config=cfg))
                except Exception as e:  # noqa: BLE001 - a config the compiler refuses
                    log(f"{name} M={m} {cfg}: {type(e).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg, err)
            t, cfg, err = best
            row.update(ours_us=1e3 * t, ours_GBps=nbytes / t / 1e6, ours_config=cfg,
                       max_abs_err=err, speedup=row["cublas_us"] / (1e3 * t))  # fmt: skip
            log(f"{name:8s} M={m:2d}: cuBLAS {row['cublas_us']:7.1f} us "
                f"({row['cublas_GBps']:6.0f} GB/s), ours {row['ours_us']:7.1f} us "
                f"({row['ours_GBps']:6.0f} GB/s) {cfg} err {err:.2e}")  # fmt: skip
            results.append(row)
    tot = {m: (sum(r["cublas_us"] for r in results if r["M"] == m),
               sum(r["ours_us"] for r in results if r["M"] == m)) for m in args.rows}  # fmt: skip
    for m, (c, o) in tot.items():
        log(f"M={m}: one of each shape: cuBLAS {c:.0f} us, ours {o:.0f} us")
    out = {"benchmark": "gemv", "env": environment(), "arch": args.arch, "results": results}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
        log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
