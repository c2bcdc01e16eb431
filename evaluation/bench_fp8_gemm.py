"""FP8 GEMM paths against bf16 at Llama-3-8B's shapes, activation quantization included; writes
the package's path table (``hf_paged/kernels/fp8/fp8_paths.json``) with ``--write-paths``.

For each weight (qkv 6144x4096, o 4096x4096, gate_up 28672x4096, down 4096x14336, lm_head
128256x4096) and M = 1, 16, 64, 256, 2048, 8192 rows, microseconds per call of:

* ``bf16``: ``F.linear`` and the bf16 layers' own dispatch (``skinny_gemm.linear``); the faster
  is the bf16 figure;
* ``quant``: the per-token-group (128) activation quantization alone (column-major scales);
* ``cublaslt``: quant + ``F.scaled_mm`` block-wise (``kernels/fp8/fp8_scaled_mm.py``);
* ``triton``: quant + the Triton block GEMM, best of a few tile configs (``kernels/fp8/fp8_gemm.py``);
* ``gemv`` (M <= 16): quant + the FP8 GEMV, best of a few configs (``kernels/fp8/fp8_gemv.py``);
* ``rowwise``: per-token quant + ``torch._scaled_mm`` row-wise (compressed-tensors' GEMM);
* producers (K = 4096 / 14336): RMSNorm+residual then quant vs the fused RMSNorm->FP8 kernel,
  SiLU-and-mul then quant vs the fused SiLU-and-mul->FP8 kernel.

``chosen`` is the fastest block path including its quant; ``speedup`` = bf16 / chosen. Every call
is timed inside a CUDA graph (as decode runs; a path that cannot be captured is reported as
such), cycling through enough weight copies that the weights come from HBM, not L2. Each path
is also checked once per shape against the W8A8 torch reference (relative max error).

Usage (one H200, ~3-5 min): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_fp8_gemm.py
[--write-paths] [--shapes qkv,down] [--rows 1,16]. JSON to ${OUT:-evaluation/results}.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log, utc_stamp
from hf_paged.kernels import fused_act, fused_norm  # noqa: E402
from hf_paged.kernels.fp8 import fp8_fused_quant, fp8_paths, fp8_scaled_mm  # noqa: E402
from hf_paged.kernels.fp8.fp8_gemm import (  # noqa: E402
    w8a8_block_matmul,
    w8a8_matmul_ref,
    w8a8_rowwise_matmul,
)
from hf_paged.kernels.fp8.fp8_gemv import fp8_gemv  # noqa: E402
from hf_paged.kernels.fp8.fp8_quant import per_token_group_quant  # noqa: E402
from hf_paged.kernels.skinny_gemm import linear as bf16_layer_linear  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336), "lm_head": (128256, 4096)}  # fmt: skip
ROWS = (1, 16, 64, 256, 2048, 8192)
BLOCK = (128, 128)
L2_BYTES = 256 * 2**20  # weight bytes cycled per timing: well past the H200's 60 MB L2


def triton_configs(m: int) -> list[dict]:
    if m <= 16:
        tiles = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3)]
    elif m <= 64:
        tiles = [(32, 64, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3)]
    else:
        tiles = [(64, 128, 4, 3), (128, 128, 8, 3), (128, 256, 8, 3), (64, 256, 4, 4)]
    return [dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, num_warps=w, num_stages=s)
            for bm, bn, w, s in tiles]  # fmt: skip


GEMV_CONFIGS = [(bn, kt, 4, st) for bn, kt, st in ((16, 2, 4), (16, 4, 3), (32, 1, 6), (32, 2, 4),
                                                  (32, 4, 3), (64, 2, 3))]  # fmt: skip


def graph_us(fn, reps: int = 20) -> float | str:
    """Microseconds per ``fn()`` from a CUDA graph of ``reps`` calls (median of 5 replays), or
    the reason the capture failed."""
    try:
        fn()  # compile / warm up outside the capture
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        graph.replay()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / reps)
        del graph
        return sorted(times)[2]
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {str(e)[:160]}"


class Cycle:
    """Round-robin over weight copies, so a graph of many calls reads the weights from HBM."""

    def __init__(self, items):
        self.items, self.i = items, 0

    def next(self):
        self.i = (self.i + 1) % len(self.items)
        return self.items[self.i]


def make_weights(n: int, k: int, gen) -> tuple[list, list, list]:
    """(bf16 copies, fp8 copies, block-scale copies) of one random weight."""
    w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
    blocks = w.view(n // 128, 128, k // 128, 128).abs().amax(dim=(1, 3)) / 448.0  # [N/128, K/128]
    q = (w / blocks.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    bf16 = w.bfloat16()
    del w
    copies = max(1, min(8, L2_BYTES // (n * k)))
    return ([bf16] + [bf16.clone() for _ in range(copies // 2)],
            [q] + [q.clone() for _ in range(copies - 1)], [blocks] * copies)  # fmt: skip


def rel(out, ref) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _best(fns: list[tuple]) -> tuple[float, object] | None:
    """(us, config) of the fastest ``(config, fn)`` that captures, or None."""
    best = None
    for cfg, fn in fns:
        t = graph_us(fn)
        if isinstance(t, float) and (best is None or t < best[0]):
            best = (t, cfg)
    return best


def _try_rel(fn, ref) -> float | str:
    try:
        return rel(fn()[:16], ref)
    except Exception as e:  # noqa: BLE001 - reported
        return f"{type(e).__name__}: {str(e)[:160]}"


def bench_rows(name: str, n: int, k: int, m: int, weights, gen) -> dict:
    """Every path at ``m`` rows of one weight shape (see the module docstring)."""
    bf16_ws, q_ws, s_ws, rowwise_s = weights
    x = torch.randn(m, k, device="cuda", generator=gen).bfloat16()
    wb, wq = Cycle(bf16_ws), Cycle(list(zip(q_ws, s_ws)))
    row = {"shape": name, "N": n, "K": k, "M": m}
    row["bf16_F.linear"] = graph_us(lambda: F.linear(x, wb.next()))
    row["bf16_layer"] = graph_us(lambda: bf16_layer_linear(x, wb.next()))
    row["quant"] = graph_us(lambda: per_token_group_quant(x, 128, column_major=True))

    def call(kind, cfg=None, w_s=None):
        def fn():
            w, s = w_s or wq.next()
            x_q, x_s = per_token_group_quant(x, 128, column_major=True)
            if kind == "cublaslt":
                return fp8_scaled_mm.block_scaled_mm(x_q, x_s, w, s)
            if kind == "gemv":
                return fp8_gemv(x_q, x_s, w, s, BLOCK, torch.bfloat16, config=cfg)
            return w8a8_block_matmul(x_q, x_s, w, s, BLOCK, torch.bfloat16, config=cfg)

        return fn

    x_q, x_s = per_token_group_quant(x[:16], 128, column_major=True)
    ref = w8a8_matmul_ref(x_q, x_s, q_ws[0], s_ws[0], BLOCK, torch.float32)
    first = (q_ws[0], s_ws[0])
    found, errors = {}, {}
    if fp8_scaled_mm.available() and fp8_scaled_mm.device_ok(x.device):
        found["cublaslt"] = _best([(None, call("cublaslt"))])
        errors["cublaslt"] = _try_rel(call("cublaslt", None, first), ref)
    found["triton"] = _best([(cfg, call("triton", cfg)) for cfg in triton_configs(m)])
    if found["triton"] is not None:
        errors["triton"] = _try_rel(call("triton", found["triton"][1], first), ref)
    if m <= 16:
        found["gemv"] = _best([(list(cfg), call("gemv", cfg)) for cfg in GEMV_CONFIGS])
        if found["gemv"] is not None:
            errors["gemv"] = _try_rel(call("gemv", tuple(found["gemv"][1]), first), ref)
    for path, best in found.items():
        row[path] = best[0] if best else "no config captured"
        if best and best[1] is not None:
            row[f"{path}_config"] = best[1]
    rw = Cycle([(q, rowwise_s) for q in q_ws])

    def rowwise():
        w, s = rw.next()
        xq, xs = per_token_group_quant(x, k)
        return w8a8_rowwise_matmul(xq, xs, w, s, torch.bfloat16)

    row["rowwise"] = graph_us(rowwise)
    row["bf16"] = min(t for t in (row["bf16_F.linear"], row["bf16_layer"]) if isinstance(t, float))
    valid = {p: v for p, v in found.items() if v is not None}
    if valid:
        path = min(valid, key=lambda p: valid[p][0])
        row["chosen"], row["chosen_us"], row["chosen_config"] = path, *valid[path]
        row["speedup"] = row["bf16"] / row["chosen_us"]
    row["rel_err_vs_w8a8_ref"] = errors
    paths = " | ".join(f"{p} {v[0]:8.1f}" for p, v in valid.items())
    log(f"{name:8s} M={m:5d}: bf16 {row['bf16']:8.1f} | quant {row['quant']} | {paths} | "
        f"rowwise {row['rowwise']} -> {row.get('chosen')} x{row.get('speedup', 0):.2f}")  # fmt: skip
    return row


def bench_shape(name: str, n: int, k: int, rows, gen) -> list[dict]:
    bf16_ws, q_ws, s_ws = make_weights(n, k, gen)
    rowwise_s = s_ws[0].amax(dim=1).repeat_interleave(128)[:n].view(n, 1).contiguous()
    out = [bench_rows(name, n, k, m, (bf16_ws, q_ws, s_ws, rowwise_s), gen) for m in rows]
    torch.cuda.empty_cache()
    return out


def bench_producer_rows(m: int, gen) -> dict:
    h = torch.randn(m, 4096, device="cuda", generator=gen).bfloat16()
    r = torch.randn_like(h)
    w = torch.rand(4096, device="cuda", generator=gen).bfloat16()
    gu = torch.randn(m, 2 * 14336, device="cuda", generator=gen).bfloat16()

    def norm_then_quant():
        y, _ = fused_norm.fused_add_rms_norm(h, r, w, 1e-5)
        return per_token_group_quant(y, 128, column_major=True)

    def act_then_quant():
        return per_token_group_quant(fused_act.silu_and_mul(gu), 128, column_major=True)

    row = {
        "M": m,
        "norm_bf16": graph_us(lambda: fused_norm.fused_add_rms_norm(h, r, w, 1e-5)),
        "norm_then_quant": graph_us(norm_then_quant),
        "norm_quant_fused": graph_us(lambda: fp8_fused_quant.rms_norm_quant(h, r, w, 1e-5, 128)),
        "act_bf16": graph_us(lambda: fused_act.silu_and_mul(gu)),
        "act_then_quant": graph_us(act_then_quant),
        "act_quant_fused": graph_us(lambda: fp8_fused_quant.silu_and_mul_quant(gu, 128)),
    }
    q1, _, _ = fp8_fused_quant.rms_norm_quant(h, r, w, 1e-5, 128)
    q2, _ = norm_then_quant()
    row["norm_fused_equal_fraction"] = (q1.float() == q2.float()).float().mean().item()
    q3, _ = fp8_fused_quant.silu_and_mul_quant(gu, 128)
    q4, _ = act_then_quant()
    row["act_fused_equal_fraction"] = (q3.float() == q4.float()).float().mean().item()
    log(f"producers M={m}: {row}")
    return row


def write_paths(results: list[dict], device: str, path: Path) -> None:
    shapes: dict = {}
    for r in results:
        if "chosen" not in r:
            continue
        entry = {"path": r["chosen"]}
        if r["chosen_config"] is not None:
            entry["config"] = r["chosen_config"]
        shapes.setdefault(f"{r['N']}x{r['K']}", {})[str(r["M"])] = entry
    table = {"about": f"Measured by evaluation/bench_fp8_gemm.py on {device} at {utc_stamp()}: "
             "the fastest block-scale FP8 path per weight shape and row class, activation "
             "quantization included (kernels/fp8/fp8_paths.py).",
             "device": device, "m_classes": sorted({r["M"] for r in results}), "shapes": shapes}  # fmt: skip
    fp8_paths.parse_table(table)  # validate before writing
    path.write_text(json.dumps(table, indent=1) + "\n")
    log(f"wrote the path table {path}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {list(SHAPES)}")
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument(
        "--write-paths",
        action="store_true",
        help="write hf_paged/kernels/fp8/fp8_paths.json (and a copy beside the results)",
    )
    args = ap.parse_args(argv)
    names = [s for s in args.shapes.split(",") if s]
    bad = sorted(set(names) - set(SHAPES))
    if bad:
        ap.error(f"--shapes {bad} are not allowed: choose from {list(SHAPES)}")
    rows = [int(m) for m in args.rows.split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    out_dir = Path(os.environ.get("OUT") or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"fp8_gemm_{utc_stamp()}.json"
    doc = {"benchmark": "fp8_gemm", "env": environment(), "torch": torch.__version__,
           "scaled_mm_blockwise": fp8_scaled_mm.available(), "results": [], "producers": []}  # fmt: skip
    t0 = time.perf_counter()
    for name in names:
        n, k = SHAPES[name]
        doc["results"] += bench_shape(name, n, k, rows, gen)
        path.write_text(json.dumps(doc, indent=1, default=str))
    doc["producers"] = [bench_producer_rows(m, gen) for m in rows if m != 64]
    doc["seconds"] = time.perf_counter() - t0
    path.write_text(json.dumps(doc, indent=1, default=str))
    log(f"wrote {path} ({doc['seconds']:.0f} s)")
    if args.write_paths:
        device = torch.cuda.get_device_name()
        write_paths(doc["results"], device, fp8_paths.TABLE_PATH)
        write_paths(doc["results"], device, out_dir / "fp8_paths.json")


if __name__ == "__main__":
    main()
