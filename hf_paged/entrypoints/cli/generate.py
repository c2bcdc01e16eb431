"""``hf-paged generate``: one JSON line per prompt on stdout, written as its request finishes.

Lines come in the order requests finish, each with its prompt's ``index`` in the input;
``--in-order`` holds a line back until every line before it is written. A line is flushed as
soon as it is known, so Ctrl-C (``interrupted``, exit status 130) keeps every finished line.
Every option that needs no model (the sampling values, the engine keys, the paths) is checked
before the model loads.

``--lora NAME=PATH`` (repeatable) serves LoRA adapters saved by PEFT: with one, every prompt runs
under it; with several, a JSON line of ``--prompts-file`` picks one with ``"lora": "NAME"`` (other
prompts run on the base model). Each output line names the adapter it ran under.
"""

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
    check_tokenizer,
    engine_kwargs,
)


def add_parser(sub) -> None:
    g = sub.add_parser(
        "generate",
        help="generate for prompts, JSON lines on stdout",
        description="Generate for each prompt; one JSON line per prompt on stdout "
        '({"index", "prompt", "text", "token_ids", "finish_reason"}), written as its request '
        "finishes. Ctrl-C keeps the lines written and exits with 130.",
    )
    g.add_argument("model_path", metavar="MODEL_PATH",
                   help="local checkpoint directory with its tokenizer, e.g. "
                   "./models/smollm2-135m-instruct (hf-paged fetch-demo-model)")  # fmt: skip
    g.add_argument("--prompt", action="append", metavar="TEXT",
                   help="a prompt (repeatable) (default: none)")  # fmt: skip
    g.add_argument("--prompts-file", metavar="FILE",
                   help='one prompt per line, or JSON lines with a "prompt" (default: none)')  # fmt: skip
    g.add_argument("--max-tokens", type=int, default=16, metavar="N",
                   help="most new tokens per prompt (default: %(default)s)")  # fmt: skip
    g.add_argument("--temperature", type=float, default=1.0, metavar="T",
                   help="0 = greedy; above 0 samples, as vLLM does (default: %(default)s)")  # fmt: skip
    g.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling mass (default: %(default)s: off)")  # fmt: skip
    g.add_argument("--top-k", type=int, default=-1, metavar="K",
                   help="sample among the K likeliest tokens (default: %(default)s: off)")  # fmt: skip
    g.add_argument("--seed", type=int, metavar="S",
                   help="prompt i samples with seed S + i (default: a random seed)")  # fmt: skip
    g.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop when the text produces TEXT (repeatable) (default: none)")  # fmt: skip
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token (default: off)")  # fmt: skip
    g.add_argument("--in-order", action="store_true",
                   help="write the lines in input order, each once all before it are written "
                   "(default: off: as requests finish)")  # fmt: skip
    g.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="a LoRA adapter saved by PEFT (repeatable): with one, every prompt "
                   'runs under it; with several, a --prompts-file JSON line picks one with '
                   '"lora": NAME (default: none)')  # fmt: skip
    g.add_argument("--max-lora-rank", type=int, metavar="R",
                   help="LoRA slot rank (default: 16)")  # fmt: skip
    add_engine_options(g)
    g.set_defaults(handler=cmd_generate, command_parser=g)


def _read_prompts_file(path: str) -> list[tuple[str, str | None]]:
    """``(prompt, lora name or None)`` per line; a line starting with ``{`` is a JSON object with
    a "prompt" and an optional "lora"."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise CliError(f"--prompts-file={path!r} is not allowed: {e.strerror}") from None
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
            raise CliError(f"--prompts-file={path!r} line {n} is not valid JSON: {e.msg}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise CliError(
                f"--prompts-file={path!r} line {n} is not allowed: a JSON line must be an object "
                'with a string "prompt"'
            )
        prompts.append((obj["prompt"], obj.get("lora")))
    return prompts


def _lora_requests(specs: list[str] | None, wanted: list[str | None]) -> list | None:
    """Per prompt, its ``LoRARequest`` (None: the base model) from ``--lora NAME=PATH``."""
    if not specs:
        if any(w is not None for w in wanted):
            raise CliError('a prompts-file line names a "lora" but no --lora NAME=PATH was given')
        return None
    from hf_paged import LoRARequest

    by_name = {}
    for i, spec in enumerate(specs, start=1):
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise CliError(f"--lora={spec!r} is not allowed: give NAME=PATH (a saved PEFT adapter)")
        by_name[name] = LoRARequest(name, i, path)
    if len(by_name) == 1 and all(w is None for w in wanted):
        return [next(iter(by_name.values()))] * len(wanted)
    unknown = sorted({w for w in wanted if w is not None} - by_name.keys())
    if unknown:
        raise CliError(f'prompts-file "lora" names {unknown} that no --lora gives; '
                       f"given: {sorted(by_name)}")  # fmt: skip
    return [None if w is None else by_name[w] for w in wanted]


def _sampling_params(args: argparse.Namespace, num_prompts: int) -> list:
    from hf_paged.config import SamplingParams  # no torch: checked before the model loads

    try:
        return [
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                stop=list(args.stop or []),
                ignore_eos=args.ignore_eos,
                seed=None if args.seed is None else args.seed + i,
            )
            for i in range(num_prompts)
        ]
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None


def cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    check_model_path(args.model_path)
    check_tokenizer(args.model_path)
    items = [(p, None) for p in args.prompt or []]
    if args.prompts_file is not None:
        items += _read_prompts_file(args.prompts_file)
    prompts = [p for p, _ in items]
    if not prompts:
        raise CliError("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE")
    loras = _lora_requests(args.lora, [w for _, w in items])
    params = _sampling_params(args, len(prompts))
    check_engine_options(args)
    kwargs = engine_kwargs(args)
    if loras is not None:
        kwargs["enable_lora"] = True
        kwargs["max_loras"] = max(1, min(len(args.lora), 8))
        if args.max_lora_rank is not None:
            kwargs["max_lora_rank"] = args.max_lora_rank
    from hf_paged import LLM

    with LLM(args.model_path, **kwargs) as llm:
        outputs = llm.stream(prompts, params, lora_request=loras)
        with contextlib.closing(outputs):  # Ctrl-C: what still runs is aborted
            _write_lines(outputs, prompts, args.in_order, _sampling_note(args), loras)
    return 0


def _sampling_note(args: argparse.Namespace) -> str | None:
    """Said on stderr with the first line: a newcomer expecting greedy output learns why it
    varies (a refusal before that stays the only line)."""
    if args.temperature <= 0:
        return None
    seed = "a random seed" if args.seed is None else f"--seed {args.seed}"
    return (
        f"hf-paged: sampling at temperature {args.temperature} with {seed}; pass "
        "--temperature 0 for greedy decoding"
    )


def _write_lines(outputs, prompts: list[str], in_order: bool, note: str | None,
                 loras: list | None = None) -> None:  # fmt: skip
    """Each finished request's line, flushed at once; in input order when asked."""
    held: dict[int, str] = {}
    next_index = 0
    for index, out in outputs:
        if note is not None:
            print(note, file=sys.stderr, flush=True)
            note = None
        c = out.outputs[0]
        row = {
            "index": index,
            "prompt": prompts[index],
            "text": c.text,
            "token_ids": c.token_ids,
            "finish_reason": c.finish_reason,
        }
        if loras is not None:
            row["lora"] = loras[index].lora_name if loras[index] is not None else None
        line = json.dumps(row, ensure_ascii=False)
        if not in_order:
            print(line, flush=True)
            continue
        held[index] = line
        while next_index in held:
            print(held.pop(next_index), flush=True)
            next_index += 1
