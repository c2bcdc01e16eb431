"""``hf-paged``: generate from the command line, run unmodified programs paged, benchmark.

    hf-paged generate MODEL_PATH --prompt "Hello" [--prompt ...] [--prompts-file FILE]
    hf-paged run [--report] script.py [args ...]     # like `python script.py args ...`
    hf-paged run [--report] -m module [args ...]     # like `python -m module args ...`
    hf-paged bench MODEL_PATH [--num-requests N ...]

``generate`` prints one JSON line per prompt: ``{"prompt", "text", "token_ids",
"finish_reason"}``. ``run`` sets ``HF_PAGED_BACKEND=paged`` (inherited by child processes),
installs the ``generate`` and ``pipeline`` dispatchers and runs the program as python would;
with ``--report`` it prints to stderr at exit how many ``generate`` calls the paged engine
served. ``bench`` times a W1-like workload (random prompts, random output lengths, EOS ignored,
greedy) with stock ``generate`` on padded batches and with ``LLM``, and prints tok/s and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

_DTYPES = ("auto", "float32", "float16", "bfloat16")


# ---- shared options --------------------------------------------------------------------------


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (EngineConfig keys; unset = the engine's default)")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-block-size", type=int)
    g.add_argument("--tensor-parallel-size", type=int)
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", choices=_DTYPES)
    g.add_argument("--enforce-eager", action="store_true", default=None)


_ENGINE_KEYS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_block_size",
    "tensor_parallel_size", "device", "dtype", "enforce_eager",
)  # fmt: skip


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k) is not None}


def _check_model_path(parser: argparse.ArgumentParser, path: str) -> None:
    if not os.path.isfile(os.path.join(path, "config.json")):
        parser.error(
            f"MODEL_PATH={path!r} is not allowed: must be a local checkpoint directory with a "
            "config.json (nothing is downloaded)"
        )


# ---- generate --------------------------------------------------------------------------------


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


def _cmd_generate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    _check_model_path(parser, args.model_path)
    prompts = list(args.prompt or [])
    if args.prompts_file is not None:
        prompts += _read_prompts_file(parser, args.prompts_file)
    if not prompts:
        parser.error("no prompts: give --prompt TEXT (repeatable) or --prompts-file FILE")
    from hf_paged import LLM, SamplingParams

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
        llm = LLM(args.model_path, **_engine_kwargs(args))
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


# ---- run -------------------------------------------------------------------------------------


class PagedCallCounter:
    """Counts the ``generate`` calls the paged engine served (dispatcher and
    ``PagedModelForCausalLM``), by wrapping ``generate_paged`` where both look it up, and, as
    ``streamed``, the batches a streaming pipeline ran in its one engine run instead of a
    ``generate`` call each."""

    def __init__(self):
        self.calls = 0
        self.streamed = 0
        self._saved = None

    def install(self) -> None:
        from hf_paged.integration import dispatch
        from hf_paged.integration import generate as gen
        from hf_paged.integration import pipeline_stream as ps

        original, outputs = gen.generate_paged, ps.model_outputs

        def counted(*args, **kwargs):
            out = original(*args, **kwargs)  # a PagedFallback raised here ran stock instead
            self.calls += 1
            return out

        def counted_batch(job):
            self.streamed += 1
            return outputs(job)

        self._saved = (dispatch.generate_paged, gen.generate_paged, ps.model_outputs)
        dispatch.generate_paged = counted  # dispatch imported the name
        gen.generate_paged = counted  # auto.py looks it up on the module
        ps.model_outputs = counted_batch

    def uninstall(self) -> None:
        from hf_paged.integration import dispatch
        from hf_paged.integration import generate as gen
        from hf_paged.integration import pipeline_stream as ps

        if self._saved is not None:
            dispatch.generate_paged, gen.generate_paged, ps.model_outputs = self._saved
            self._saved = None


def _parse_run(argv: list[str]) -> tuple[bool, str | None, str | None, list[str]]:
    """``(report, module, script, args)`` from what follows ``run``, parsed as python parses
    its own command line: our options stop at the first program argument."""
    report, i = False, 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        if argv[i] in ("-h", "--help"):
            print(_RUN_USAGE)
            raise SystemExit(0)
        if argv[i] != "--report":
            _usage_error(f"run: option {argv[i]!r} is not allowed: options are --report, -m")
        report, i = True, i + 1
    rest = argv[i:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            _usage_error("run: -m needs a module name: hf-paged run -m module [args ...]")
        return report, rest[1], None, rest[2:]
    if not rest:
        _usage_error("run: missing the program: hf-paged run script.py [args ...]")
    if not os.path.isfile(rest[0]):
        _usage_error(f"run: script={rest[0]!r} is not allowed: no such file")
    return report, None, rest[0], rest[1:]


_RUN_USAGE = """usage: hf-paged run [--report] script.py [args ...]
       hf-paged run [--report] -m module [args ...]

Run a program unmodified, with every transformers generate call on the paged engine
(HF_PAGED_BACKEND=paged). --report prints to stderr at exit how many calls the engine served."""


def _usage_error(message: str) -> None:
    print(f"hf-paged: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _cmd_run(argv: list[str]) -> int:
    report, module, script, args = _parse_run(argv)
    os.environ["HF_PAGED_BACKEND"] = "paged"  # child processes inherit it
    import hf_paged  # noqa: F401  (installs the dispatcher once the package does so on import)
    from hf_paged import envs
    from hf_paged.integration import dispatch
    from hf_paged.integration.lm_eval import install_lm_eval
    from hf_paged.integration.pipeline import install_pipeline

    envs.reset("HF_PAGED_BACKEND")  # this process reads it again too (it is read once)
    dispatch.install()
    install_pipeline()
    install_lm_eval()  # HFLM's requests on the engine; `--model hf-paged` (when lm-eval is installed)
    counter = PagedCallCounter()
    if report:
        counter.install()
    try:
        if module is not None:
            sys.argv = [module, *args]  # run_module replaces argv[0] with the module's file
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        if report:
            counter.uninstall()
            print(
                f"hf_paged: {counter.calls + counter.streamed} generate call(s) served by the paged "
                "engine",
                file=sys.stderr,
                flush=True,
            )
    return 0


def _cmd_bench(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hf_paged.cli_bench import cmd_bench  # torch and transformers load only when benching

    return cmd_bench(parser, args)


# ---- entry point -----------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-paged",
        description="Generate from the command line, run unmodified programs with generate on "
        "the paged engine, benchmark against stock generate.",
    )
    sub = parser.add_subparsers(dest="command", metavar="{generate,run,bench}")

    g = sub.add_parser("generate", help="generate for prompts, JSON lines on stdout")
    g.add_argument("model_path", metavar="MODEL_PATH", help="local checkpoint directory")
    g.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    g.add_argument("--prompts-file", help='one prompt per line, or JSON lines with "prompt"')
    g.add_argument("--max-tokens", type=int, default=16)
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--seed", type=int, help="prompt i samples with seed + i")
    g.add_argument("--ignore-eos", action="store_true")
    _add_engine_options(g)
    g.set_defaults(handler=_cmd_generate, command_parser=g)

    sub.add_parser("run", help="run a program with generate on the paged engine", add_help=False)

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
    _add_engine_options(b)
    b.set_defaults(handler=_cmd_bench, command_parser=b)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``hf-paged``). Returns the exit code; bad input exits with 2 and
    a message naming the argument, the value and what is allowed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        return _cmd_run(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "handler", None) is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.handler(args.command_parser, args)
    except (TypeError, ValueError, OSError, RuntimeError) as e:  # bad input met at run time
        args.command_parser.error(_one_line(e))  # usage + one line, exit 2, no traceback


def _one_line(e: BaseException) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
