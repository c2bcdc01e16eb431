"""How ``hf-paged`` fails: one line on stderr, ``hf-paged <command>: error: ...``.

argparse's own errors (an unknown or mistyped option, a missing ``MODEL_PATH``, a value of the
wrong type) print the command's usage block first, as argparse does: they are about how the
command was typed. What is found after parsing (a path that is no checkpoint, a value out of
range, a model the engine refuses, a prompt too long, no CUDA) is said in one line, without the
usage block. Ctrl-C prints ``interrupted`` and exits with 130, as a shell reports SIGINT.
"""

from __future__ import annotations

import sys

EXIT_BAD_INPUT = 2  # argparse's status for a usage error; ours for every refusal
EXIT_INTERRUPTED = 130  # 128 + SIGINT


class CliError(Exception):
    """Bad input found after parsing; ``main`` says it in one line and exits with 2."""


def say_error(command: str, message: str) -> int:
    """Print ``hf-paged <command>: error: <message>`` on stderr; the exit status to return."""
    print(f"hf-paged {command}: error: {message}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT


def say_interrupted(command: str) -> int:
    print(f"hf-paged {command}: interrupted", file=sys.stderr, flush=True)
    return EXIT_INTERRUPTED


def one_line(e: BaseException) -> str:
    """The first non-empty line of an exception's message (a worker's traceback and other
    detail follow it), or its type's name."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
