"""Run a test module's kernel cases under Triton's CPU interpreter in a child process.

``TRITON_INTERPRET`` must be set before triton is first imported, and other test modules import
it normally, so each interpreter module re-runs itself as a script with the variable set and
prints a JSON dict {case: result} on its last line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_interpreter_cases(script: str, timeout: float) -> dict:
    """Run ``script`` with ``TRITON_INTERPRET=1``; its results dict. Skips without triton."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, script], env=env, cwd=ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    if proc.returncode != 0:
        pytest.fail(f"interpreter run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


class CaseResults(dict):
    """The child's ``{case: float or traceback}``; reading a case that raised fails the test
    with its traceback, so a test compares floats only."""

    def __getitem__(self, name: str) -> float:
        value = super().__getitem__(name)
        if isinstance(value, str):
            pytest.fail(f"case {name!r} raised under the interpreter:\n{value}")
        return value


def interpret_main(cases: dict) -> None:
    """The child side: run every ``{name: (fn, args)}`` case, print ``{name: float or
    traceback}`` as JSON (one failing case does not hide the others)."""
    import traceback

    assert os.environ.get("TRITON_INTERPRET") == "1", "run with TRITON_INTERPRET=1"
    results = {}
    for name, (fn, args) in cases.items():
        try:
            results[name] = float(fn(*args))
        except Exception:
            results[name] = traceback.format_exc()
    print(json.dumps(results))
