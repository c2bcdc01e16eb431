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


def random_lora(rank: int, num_tokens: int = 37, num_slots: int = 4, k: int = 48, n: int = 40,
                dtype=None, device="cpu", seed: int = 0, no_adapter: bool = False):  # fmt: skip
    """A random LoRA problem for the LoRA kernels: ``x`` [T, K], the stacked factors ``a``
    [S, R, K] and ``b`` [S, N, R], an output ``out`` [T, N + 24] (a fused layer's: the LoRA
    columns start at 8), ``scales`` [S] and each token's slot, a list: mixed and unsorted, some
    tokens without an adapter (-1, every one with ``no_adapter``), slot 2 never used."""
    import torch

    gen = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(num_tokens, k, generator=gen)
    a = torch.randn(num_slots, rank, k, generator=gen) / k**0.5
    b = torch.randn(num_slots, n, rank, generator=gen)
    scales = torch.rand(num_slots, generator=gen) + 0.5
    slots = [-1 if no_adapter else [0, 1, 3, -1][(7 * t + seed) % 4] for t in range(num_tokens)]
    out = torch.randn(num_tokens, n + 24, generator=gen)
    x, a, b, out = (t.to(device=device, dtype=dtype or torch.float32) for t in (x, a, b, out))
    return x, a, b, out, scales.to(device), slots


def assert_lora_bf16_close(reference, kernel, rank: int, num_tokens: int, k: int,
                           index_of) -> None:  # fmt: skip
    """A LoRA kernel (``kernel(x, out, a, b, scales, index, offset)``) on a bf16 CUDA
    ``random_lora`` problem equals its torch ``reference`` run in fp32 on the same inputs, to
    bf16's tolerance; ``index_of(slots)`` is the kernel's token index. Skips without CUDA."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x, a, b, out, scales, slots = random_lora(rank, num_tokens, k=k, n=768, dtype=torch.bfloat16,
                                              device="cuda")  # fmt: skip
    index = index_of(slots)
    want, got = out.float().clone(), out.clone()
    reference(x.float(), want, a.float(), b.float(), scales, index, offset=8)
    kernel(x, got, a, b, scales, index, offset=8)
    torch.testing.assert_close(got.float(), want, atol=0.1, rtol=0.02)
