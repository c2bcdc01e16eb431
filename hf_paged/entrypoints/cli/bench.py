"""``hf-paged bench``: a W1-like workload (random prompts, random output lengths, EOS ignored,
greedy) through stock ``generate`` on padded batches and through ``LLM``; tok/s and the ratio."""

from __future__ import annotations

import argparse
import json
import random
import time

from hf_paged.entrypoints.cli.options import add_engine_options, check_model_path, engine_kwargs


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="stock generate vs paged on a W1-like workload")
    b.add_argument("model_path", metavar="MODEL_PATH", help="local checkpoint directory")
    b.add_argument("--num-requests", type=int, default=16)
    b.add_argument("--min-input-len", type=int, default=16)
    b.add_argument("--max-input-len", type=int, default=64)
    b.add_argument("--min-output-len", type=int, default=16)
    b.add_argument("--max-output-len", type=int, default=64)
    b.add_argument("--hf-batch-size", type=int, default=64, help="stock generate's batch size")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--skip-hf", action="store_true", help="time the paged engine only")
    b.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    add_engine_options(b)
    b.set_defaults(handler=cmd_bench, command_parser=b)


def _workload(args: argparse.Namespace, vocab_size: int) -> tuple[list[list[int]], list[int]]:
    """W1's shape, scaled: random prompt ids < min(10000, vocab) (skipping the first 4, which
    are often special), random prompt and output lengths."""
    rng = random.Random(args.seed)
    hi = min(10000, vocab_size)
    prompts = [
        [rng.randrange(4, hi) for _ in range(rng.randint(args.min_input_len, args.max_input_len))]
        for _ in range(args.num_requests)
    ]
    outputs = [
        rng.randint(args.min_output_len, args.max_output_len) for _ in range(args.num_requests)
    ]
    return prompts, outputs


def _bench_hf(path: str, prompts, out_lens, batch_size: int, device: str, dtype) -> float:
    """Stock generate on left-padded batches, each row stopped at its own length; seconds."""
    import copy

    import torch
    from transformers import AutoModelForCausalLM, StoppingCriteria

    class RowLengths(StoppingCriteria):
        def __init__(self, ends):
            self.ends = ends  # [B] total length at which each row is done

        def __call__(self, input_ids, scores, **kwargs):
            return input_ids.shape[1] >= self.ends

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    # EOS ignored: unset on this private copy of the model too, or generate fills it back in
    model.generation_config.eos_token_id = model.config.eos_token_id = None
    gen = copy.deepcopy(model.generation_config)
    gen.do_sample = False
    gen.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else 0

    def run(ps, lens):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[gen.pad_token_id] * (width - len(p)) + p for p in ps], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
        ends = torch.tensor([width + n for n in lens], device=device)
        call_gen = copy.copy(gen)
        call_gen.max_new_tokens = max(lens)
        model.generate(
            input_ids=ids, attention_mask=mask, generation_config=call_gen,
            stopping_criteria=[RowLengths(ends)],
        )  # fmt: skip

    run(prompts[:1], [2])  # warm-up
    _sync(device)
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        run(prompts[i : i + batch_size], out_lens[i : i + batch_size])
    _sync(device)
    return time.perf_counter() - start  # the model is freed on return


def _bench_paged(path: str, prompts, out_lens, engine_kwargs: dict) -> tuple[float, str, object]:
    """``LLM`` on all requests at once; ``(seconds, device, dtype)``."""
    from hf_paged import LLM, SamplingParams

    with LLM(path, **engine_kwargs) as llm:
        device, dtype = llm.engine.runtime.device, llm.engine.runtime.dtype
        llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
        _sync(device)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        _sync(device)
        return time.perf_counter() - start, device, dtype


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def _check_bench_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("num_requests", "min_input_len", "min_output_len", "hf_batch_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}={getattr(args, name)} is not allowed: >= 1")
    for lo, hi in (("min_input_len", "max_input_len"), ("min_output_len", "max_output_len")):
        if getattr(args, hi) < getattr(args, lo):
            parser.error(
                f"--{hi.replace('_', '-')}={getattr(args, hi)} is not allowed: must be >= "
                f"--{lo.replace('_', '-')}={getattr(args, lo)}"
            )


def cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_path(parser, args.model_path)
    _check_bench_args(parser, args)
    from transformers import AutoConfig

    from hf_paged.config import EngineConfig

    try:
        EngineConfig.from_dict(engine_kwargs(args))
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    vocab = AutoConfig.from_pretrained(args.model_path).vocab_size
    prompts, out_lens = _workload(args, vocab)
    total = sum(out_lens)
    # the engine goes second: on a GPU its KV cache takes the memory the HF model had
    rows = []
    if not args.skip_hf:
        import torch

        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = None if (args.dtype or "auto") == "auto" else getattr(torch, args.dtype)
        hf_s = _bench_hf(args.model_path, prompts, out_lens, args.hf_batch_size, device, dtype)
        rows.append(("hf", hf_s))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    paged_s, device, dtype = _bench_paged(args.model_path, prompts, out_lens, engine_kwargs(args))
    rows.append(("paged", paged_s))
    _print_bench(rows, total, len(prompts), device, dtype, args.json)
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
