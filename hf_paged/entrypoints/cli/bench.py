"""``hf-paged bench``: a W1-like workload (W1's draw of random prompts and output lengths, EOS
ignored, greedy) through stock ``generate`` on padded batches and through ``LLM``, with the
runners ``evaluation/`` uses (``hf_paged.benchmarks``); tok/s and the ratio."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from hf_paged.entrypoints.cli.errors import CliError
from hf_paged.entrypoints.cli.options import (
    add_engine_options,
    check_engine_options,
    check_model_path,
    engine_kwargs,
)


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="stock generate vs paged on a W1-like workload")
    b.add_argument("model_path", metavar="MODEL_PATH", help="local checkpoint directory")
    d = " (default: %(default)s)"
    b.add_argument("--num-requests", type=int, default=16, metavar="N", help="requests" + d)
    b.add_argument("--min-input-len", type=int, default=16, metavar="N",
                   help="shortest prompt, in tokens" + d)  # fmt: skip
    b.add_argument("--max-input-len", type=int, default=64, metavar="N",
                   help="longest prompt, in tokens" + d)  # fmt: skip
    b.add_argument("--min-output-len", type=int, default=16, metavar="N",
                   help="fewest new tokens of a request" + d)  # fmt: skip
    b.add_argument("--max-output-len", type=int, default=64, metavar="N",
                   help="most new tokens of a request" + d)  # fmt: skip
    b.add_argument("--hf-batch-size", type=int, default=64, metavar="N",
                   help="stock generate's batch size" + d)  # fmt: skip
    b.add_argument("--seed", type=int, default=0, metavar="S", help="the workload's draw" + d)
    b.add_argument("--skip-hf", action="store_true",
                   help="time the paged engine only (default: off)")  # fmt: skip
    b.add_argument("--json", action="store_true",
                   help="one JSON object instead of a table (default: off)")  # fmt: skip
    add_engine_options(b)
    b.set_defaults(handler=cmd_bench, command_parser=b)


def _workload(args: argparse.Namespace, vocab_size: int):
    """W1's draw (``benchmarks.workloads.make_requests``), scaled: prompt ids below
    min(10000, vocab), prompt and output lengths from the command line."""
    from hf_paged.benchmarks.workloads import Workload, make_requests

    prompts, outputs = make_requests(
        args.num_requests,
        (args.min_input_len, args.max_input_len),
        (args.min_output_len, args.max_output_len),
        vocab_limit=min(10000, vocab_size),
        seed=args.seed,
    )
    return Workload("cli", args.model_path, prompts, outputs)


def _bench_hf(path: str, wl, batch_size: int, device: str, dtype) -> float:
    """Stock generate on left-padded batches, each row stopped at its own length; seconds."""
    from transformers import AutoModelForCausalLM

    from hf_paged.benchmarks.runners import run_stock

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    # EOS ignored: unset on this private copy of the model too, or generate fills it back in
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    return run_stock(model, wl, batch_size, device)["wall_s"]  # the model is freed on return


def _bench_paged(path: str, wl, engine_kwargs: dict, device: str) -> tuple[float, str, str]:
    """``LLM`` on all requests at once; ``(seconds, device, dtype)`` of the engine."""
    from hf_paged.benchmarks.runners import run_llm

    row = run_llm(path, wl, engine_kwargs, device)
    return row["wall_s"], row["device"], row["dtype"]


def _check_bench_args(args: argparse.Namespace) -> None:
    for name in ("num_requests", "min_input_len", "min_output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: >= 1")
    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if getattr(args, hi) < getattr(args, lo):
            raise CliError(
                f"--{hi.replace('_', '-')}={getattr(args, hi)} is not allowed: must be >= "
                f"--{lo.replace('_', '-')}={getattr(args, lo)}"
            )


def cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_path(args.model_path)
    _check_bench_args(args)
    check_engine_options(args)
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
    wl = _workload(args, vocab)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # the engine goes second: on a GPU its KV cache takes the memory the HF model had
    rows = []
    with contextlib.redirect_stdout(sys.stderr):  # the runners' progress lines; stdout: results
        if not args.skip_hf:
            dtype = None if (args.dtype or "auto") == "auto" else getattr(torch, args.dtype)
            rows.append(("hf", _bench_hf(args.model_path, wl, args.hf_batch_size, device, dtype)))
        paged_s, device, dtype = _bench_paged(args.model_path, wl, engine_kwargs(args), device)
    rows.append(("paged", paged_s))
    _print_bench(rows, wl.num_output_tokens, wl.num_requests, device, dtype, args.json)
    return 0


def _print_bench(rows, total: int, n: int, device: str, dtype, as_json: bool) -> None:
    base = rows[0][1] if rows[0][0] == "hf" else None
    results = [
        {
            "backend": name,
            "requests": n,
            "output_tokens": total,
            "seconds": round(s, 4),
            "tok_per_s": round(total / s, 1),
            "vs_hf": None if base is None else round(base / s, 2),
        }
        for name, s in rows
    ]
    if as_json:
        print(json.dumps({"device": device, "dtype": str(dtype), "results": results}))
        return
    print(f"device={device} dtype={dtype}")
    print(
        f"{'backend':<8} {'requests':>8} {'out_tokens':>10} {'seconds':>9} {'tok/s':>9} {'vs hf':>6}"
    )
    for r in results:
        ratio = "-" if r["vs_hf"] is None else f"{r['vs_hf']:.2f}x"
        print(
            f"{r['backend']:<8} {r['requests']:>8} {r['output_tokens']:>10} "
            f"{r['seconds']:>9.3f} {r['tok_per_s']:>9.1f} {ratio:>6}"
        )
