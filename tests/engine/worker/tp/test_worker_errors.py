"""What a dead tensor-parallel worker's ``EngineDeadError`` says first: the cause and the fix
where the worker's own last line does not say them (a script without a ``__main__`` guard, whose
spawned worker re-runs it and dies with a link to Python's docs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged.engine.worker.tp.workers import EngineDeadError
from hf_paged.testing import save_checkpoint

ROOT = Path(__file__).resolve().parents[4]
NO_GUARD = """\
from hf_paged import LLM, SamplingParams

llm = LLM({path!r}, tensor_parallel_size=2, device="cpu", num_kv_blocks=16, kv_block_size=4)
print(llm.generate("hi", SamplingParams(max_tokens=2, temperature=0))[0].token_ids)
"""


def test_a_worker_traceback_keeps_its_own_last_line():
    err = EngineDeadError(1, "Traceback ...\nValueError: bad shard", "raised an exception")
    assert str(err).splitlines()[0] == (
        "tensor-parallel worker rank 1 raised an exception: ValueError: bad shard"
    )


def test_a_script_without_a_main_guard_is_told_the_cause_and_the_fix(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD.format(path=save_checkpoint(str(tmp_path / "llama"))))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("HF_PAGED_BACKEND", None)
    try:
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=240)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("a script without a __main__ guard hung instead of failing")
    assert out.returncode != 0
    first = [line for line in out.stderr.splitlines() if line.startswith("hf_paged.") and
             "EngineDeadError:" in line]  # fmt: skip
    assert first, out.stderr[-3000:]
    assert 'no `if __name__ == "__main__":` guard' in first[-1]
    assert "Fix: put the code that builds the LLM" in first[-1]
    assert "docs.python.org" not in first[-1]
