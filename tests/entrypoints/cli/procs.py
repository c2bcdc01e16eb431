"""Plumbing of the CLI and examples tests: python from the repo root, read back; and the
command run in this process (``run_cli``)."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def start_python(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """``python ARGS`` from the repo root with the repo importable; read with ``finish``."""
    full_env = {**os.environ, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env.pop("HF_PAGED_BACKEND", None)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)``; kills the process on timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``hf-paged ARGV`` (``main(argv)``) in this process: ``(exit code, stdout, stderr)``."""
    from hf_paged.entrypoints.cli import main

    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out = capsys.readouterr()
    return code, out.out, out.err
