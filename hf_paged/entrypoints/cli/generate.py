"""``hf-paged generate``: one JSON line per prompt on stdout.

``--lora NAME=PATH`` (repeatable) serves LoRA adapters saved by PEFT: with one, every prompt runs
under it; with several, a JSON line of ``--prompts-file`` picks one with ``"lora": "NAME"`` (other
prompts run on the base model). Each output line names the adapter it ran under."""

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
    g.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter saved by PEFT (repeatable); see the module docstring",
    )
    g.add_argument("--max-lora-rank", type=int, help="LoRA slot rank (default 16)")
    add_engine_options(g)
    g.set_defaults(handler=cmd_generate, command_parser=g)


def _read_prompts_file(parser: argparse.ArgumentParser, path: str) -> list[tuple[str, str | None]]:
    """``(prompt, lora name or None)`` per line; a line starting with ``{`` is a JSON object with
    a "prompt" and an optional "lora"."""
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
            prompts.append((line, None))
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
        prompts.append((obj["prompt"], obj.get("lora")))
    return prompts


def _lora_requests(parser, specs: list[str] | None, wanted: list[str | None]) -> list | None:
    """Per prompt, its ``LoRARequest`` (None: the base model) from ``--lora NAME=PATH``."""
    if not specs:
        if any(w is not None for w in wanted):
            parser.error('a prompts-file line names a "lora" but no --lora NAME=PATH was given')
        return None
    from hf_paged import LoRARequest

    by_name = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            parser.error(f"--lora={spec!r} is not allowed: give NAME=PATH (a saved PEFT adapter)")
        by_name[name] = LoRARequest(name, i, path)
    if len(by_name) == 1 and all(w is None for w in wanted):
        return [next(iter(by_name.values()))] * len(wanted)
    unknown = sorted({w for w in wanted if w is not None} - by_name.keys())
    if unknown:
        parser.error(f'prompts-file "lora" names {unknown} that no --lora gives; '
                     f"given: {sorted(by_name)}")  # fmt: skip
    return [None if w is None else by_name[w] for w in wanted]


def cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_path(parser, args.model_path)
    items = [(p, None) for p in args.prompt or []]
    if args.prompts_file is not None:
        items += _read_prompts_file(parser, args.prompts_file)
    prompts = [p for p, _ in items]
    loras = _lora_requests(parser, args.lora, [w for _, w in items])
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
        kwargs = engine_kwargs(args)
        if loras is not None:
            kwargs["enable_lora"] = True
            kwargs["max_loras"] = max(1, min(len(args.lora), 8))
            if args.max_lora_rank is not None:
                kwargs["max_lora_rank"] = args.max_lora_rank
        llm = LLM(args.model_path, **kwargs)
    except (TypeError, ValueError) as e:
        parser.error(str(e))
    with llm:
        if llm.tokenizer is None:
            parser.error(f"MODEL_PATH={args.model_path!r} has no tokenizer saved beside it")
        try:
            outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty(), lora_request=loras)
        except ValueError as e:  # an adapter the engine can't serve, named
            parser.error(str(e))
    for i, (prompt, out) in enumerate(zip(prompts, outs, strict=True)):
        c = out.outputs[0]
        row = {
            "prompt": prompt,
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
        }
        if loras is not None:
            row["lora"] = loras[i].lora_name if loras[i] is not None else None
        print(json.dumps(row, ensure_ascii=False), flush=True)
    return 0
