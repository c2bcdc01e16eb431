"""Subprocess plumbing of the CLI and examples tests: python from the repo root, read back."""

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
