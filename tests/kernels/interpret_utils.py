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


def random_paged_kv(context_lens: list[int], num_kv_heads: int, head_dim: int, block_size: int,
                    gen):  # fmt: skip
    """A random paged KV batch on the CPU (fp32): K and V caches ``[num_blocks, block_size, Hkv,
    D]`` of the blocks ``context_lens`` need and 3 spare, and block tables ``[B, max blocks +
    1]`` (int32, padded with 0) naming each sequence's blocks in a shuffled order."""
    import torch

    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).int()
    block_tables = torch.zeros(len(context_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n]
        used += n
    return k_cache, v_cache, block_tables


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
