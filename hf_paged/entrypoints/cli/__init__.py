"""``hf-paged``: generate from the command line, run unmodified programs paged, benchmark.

    hf-paged generate MODEL_PATH --prompt "Hello" [--prompt ...] [--prompts-file FILE]
    hf-paged run [--report] script.py [args ...]     # like `python script.py args ...`
    hf-paged run [--report] -m module [args ...]     # like `python -m module args ...`
    hf-paged bench MODEL_PATH [--num-requests N ...]
    hf-paged fetch-demo-model [DIR]                 # SmolLM2-135M-Instruct, without the hub
    hf-paged --version

``generate`` prints one JSON line per prompt as it finishes (``generate.py``); ``run`` runs a
program with every ``generate`` call on the engine (``run.py``); ``bench`` times stock
``generate`` against the engine on a W1-like workload (``bench.py``); ``fetch-demo-model`` writes
the demo model (``fetch_demo_model.py``). Nothing heavy is imported before a command needs it, so
``--help`` answers at once. How a command fails: ``errors.py``.
"""

from __future__ import annotations

import argparse
import atexit
import difflib
import os
import sys

from hf_paged.entrypoints.cli.errors import (
    EXIT_INTERRUPTED,
    CliError,
    one_line,
    say_error,
    say_interrupted,
)

EPILOG = """\
HF_PAGED_BACKEND=paged sends every generate call of any Python program in this environment to
the engine, as `hf-paged run` does: installing hf_paged adds a start-up hook
(hf_paged_backend.pth) that imports hf_paged only when the variable is set. Where the hook is
not installed, the program needs `import hf_paged` or `hf-paged run`.

exit status: 0 done, 2 bad input or a refusal (one line on stderr), 130 interrupted (Ctrl-C)."""


def build_parser() -> argparse.ArgumentParser:
    from hf_paged import __version__
    from hf_paged.entrypoints.cli import bench, fetch_demo_model, generate

    parser = argparse.ArgumentParser(
        prog="hf-paged",
        description="Generate from the command line, run unmodified programs with generate on "
        "the paged engine, benchmark against stock generate.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hf-paged {__version__}",
                        help="print the version and exit")  # fmt: skip
    sub = parser.add_subparsers(dest="command", metavar="{generate,run,bench,fetch-demo-model}")
    generate.add_parser(sub)
    sub.add_parser("run", help="run a program with generate on the paged engine "
                   "(hf-paged run --help)", add_help=False)  # fmt: skip
    bench.add_parser(sub)
    fetch_demo_model.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Console entry point (``hf-paged``). Returns the exit status: 0, 2 for bad input (a usage
    error, or one line naming the argument, the value and what is allowed), 130 on Ctrl-C."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["run"]:
        from hf_paged.entrypoints.cli.run import cmd_run

        return cmd_run(argv[1:])
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if getattr(args, "handler", None) is None:
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        parser.print_help(sys.stderr)
        return 2
    if unknown:  # the command's usage, not the top level's
        args.command_parser.error(_unrecognized(args.command_parser, unknown))
    try:
        return args.handler(args.command_parser, args)
    except KeyboardInterrupt:
        return say_interrupted(args.command)
    except CliError as e:
        return say_error(args.command, str(e))
    except (TypeError, ValueError, OSError, RuntimeError) as e:  # refused at run time
        return say_error(args.command, one_line(e))


def console_main() -> None:
    """The ``hf-paged`` script: ``main``, then exit. After Ctrl-C the engine is closed and the
    output flushed, so the process leaves at once instead of tearing down torch's modules
    (seconds on a loaded machine): atexit handlers run, the interpreter's teardown does not."""
    code = main()
    if code == EXIT_INTERRUPTED:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(code)
    raise SystemExit(code)


def _unrecognized(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """argparse's message, with the nearest option for a mistyped one."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    options = [s for a in parser._actions for s in a.option_strings]
    for arg in unknown:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.partition("=")[0], options, n=1)
            if near:
                return f"{message} (did you mean {near[0]}?)"
    return message


if __name__ == "__main__":
    console_main()
