"""``hf-paged generate``: one JSON line per prompt on stdout."""

from __future__ import annotations

import argparse
import json
import sys

from hf_paged.entrypoints.cli.options import add_engine_options, check_model_path, engine_kwargs


def add_parser(sub) -> None:
    g = sub.add_parser("generate", help="generate for prompts, JSON lines on stdout")
    g.add_argument("model_path", metavar="MODEL_PATH", help="local checkpoint directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help='one prompt per line, or JSON lines with "prompt"')
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=1.0,
                   help="1.0 (the default) samples, as vLLM does; 0 = greedy")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--seed", type=int, help="prompt i samples with seed + i")
    g.add_argument("--ignore-eos", action="store_true")
    add_engine_options(g)
    g.set_defaults(handler=cmd_generate, command_parser=g)


def _read_prompts_file(parser: argparse.ArgumentParser, path: str) -> list[str]:
    """One prompt per line; a line starting with ``{`` is a JSON object with a "prompt"."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        parser.error(f"--prompts-file={path!r} is not allowed: {e.strerror}")
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            prompts.append(line)
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            parser.error(f"--prompts-file={path!r} line {n} is not valid JSON: {e.msg}")
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            parser.error(
                f"--prompts-file={path!r} line {n} is not allowed: a JSON line must be an object "
                'with a string "prompt"'
            )
        prompts.append(obj["prompt"])
    return prompts


def cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_path(parser, args.model_path)
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        prompts += _read_prompts_file(parser, args.prompts_file)
    if not prompts:
        parser.error("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE")
    from hf_paged import LLM, SamplingParams

    if args.temperature > 0:
        seed = "a random seed" if args.seed is None else f"--seed {args.seed}"
        print(
            f"hf-paged: sampling at temperature {args.temperature} with {seed}; pass "
            "--temperature 0 for greedy decoding",
            file=sys.stderr,
        )
    try:
        params = [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                ignore_eos=args.ignore_eos,
                seed=None if args.seed is None else args.seed + i,
            )
            for i in range(len(prompts))
        ]
        llm = LLM(args.model_path, **engine_kwargs(args))
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    with llm:
        if llm.tokenizer is None:
            parser.error(f"MODEL_PATH={args.model_path!r} has no tokenizer saved beside it")
        outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
    for prompt, out in zip(prompts, outs, strict=True):
        c = out.outputs[0]
        row = {
            "prompt": prompt,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
        }
        print(json.dumps(row, ensure_ascii=False), flush=True)
    return 0
