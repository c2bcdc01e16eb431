"""``hf-paged``: generate from the command line, run unmodified programs paged, benchmark.

    hf-paged generate MODEL_PATH --prompt "Hello" [--prompt ...] [--prompts-file FILE]
    hf-paged run [--report] script.py [args ...]     # like `python script.py args ...`
    hf-paged run [--report] -m module [args ...]     # like `python -m module args ...`
    hf-paged bench MODEL_PATH [--num-requests N ...]
    hf-paged --version

``generate`` prints one JSON line per prompt (``generate.py``); ``run`` runs a program with every
``generate`` call on the engine (``run.py``); ``bench`` times stock ``generate`` against the engine
on a W1-like workload (``bench.py``). Nothing heavy is imported before a command needs it, so
``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from hf_paged import __version__
    from hf_paged.entrypoints.cli import bench, generate

    parser = argparse.ArgumentParser(
        prog="hf-paged",
        description="Generate from the command line, run unmodified programs with generate on "
        "the paged engine, benchmark against stock generate.",
    )
    parser.add_argument("--version", action="version", version=f"hf-paged {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{generate,run,bench}")
    generate.add_parser(sub)
    sub.add_parser("run", help="run a program with generate on the paged engine", add_help=False)
    bench.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``hf-paged``). Returns the exit code; bad input exits with 2 and
    a message naming the argument, the value and what is allowed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from hf_paged.entrypoints.cli.run import cmd_run

        return cmd_run(argv[1:])
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
