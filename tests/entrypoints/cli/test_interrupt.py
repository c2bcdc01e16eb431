"""Ctrl-C keeps what finished: ``hf-paged generate`` writes each line as its request finishes
(in input order with ``--in-order``); SIGINT prints ``interrupted`` and exits with 130, no
traceback, with or without tensor parallelism (gloo on CPU), within 3 s, leaving no worker."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from hf_paged.entrypoints.cli.generate import _write_lines
from hf_paged.testing import save_demo_model
from tests.entrypoints.cli.procs import REPO

EXIT_WITHIN_S = 3.0


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("sigint") / "m"))


def _output(text: str) -> SimpleNamespace:
    completion = SimpleNamespace(text=text, token_ids=[1], finish_reason="length")
    return SimpleNamespace(outputs=[completion])


@pytest.mark.parametrize("in_order", [False, True])
def test_each_line_is_written_when_it_is_known(monkeypatch, in_order):
    """Requests finish as 2, 0, 1: each line is on stdout before the next request finishes;
    ``--in-order`` holds 2 back until 0 and 1 are written."""
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    written_before = []

    def finishing():
        for index in (2, 0, 1):
            written_before.append([json.loads(x)["index"] for x in out.getvalue().splitlines()])
            yield index, _output(f"t{index}")
        written_before.append([json.loads(x)["index"] for x in out.getvalue().splitlines()])

    _write_lines(finishing(), ["p0", "p1", "p2"], in_order, None)
    if in_order:
        assert written_before == [[], [], [0], [0, 1, 2]]
    else:
        assert written_before == [[], [2], [2, 0], [2, 0, 1]]
    rows = [json.loads(x) for x in out.getvalue().splitlines()]
    assert all(row["prompt"] == f"p{row['index']}" == "p" + row["text"][1:] for row in rows)


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2_gloo"])
def test_ctrl_c_keeps_the_finished_lines_and_exits_130(ckpt, tp):
    """One request at a time (``--max-num-seqs 1``), so lines come one by one; Ctrl-C after the
    first reaches the whole process group, as a terminal sends it (workers included)."""
    prompts = sum((["--prompt", f"p{i}"] for i in range(100)), [])
    cmd = [sys.executable, "-m", "hf_paged.entrypoints.cli", "generate", ckpt, "--temperature",
           "0", "--max-tokens", "24", "--ignore-eos", "--max-num-seqs", "1", "--device", "cpu",
           "--num-kv-blocks", "64", "--tensor-parallel-size", str(tp), "--in-order", *prompts]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    env.pop("HF_PAGED_BACKEND", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        first = proc.stdout.readline()  # written while the others still run
        assert first, proc.communicate(timeout=60)[1][-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        proc.wait(timeout=60)
        took = time.monotonic() - sent
        rest, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130, err[-3000:]
    assert err.strip().splitlines()[-1] == "hf-paged generate: interrupted", err[-3000:]
    assert "Traceback" not in err
    assert took < EXIT_WITHIN_S, f"exited {took:.1f} s after Ctrl-C"
    rows = [json.loads(line) for line in [first, *rest.splitlines()]]
    assert [row["index"] for row in rows] == list(range(len(rows))) and len(rows) < 100
    assert all(len(row["token_ids"]) == 24 for row in rows)
    _no_process_left(proc.pid)


def _no_process_left(pgid: int, wait_s: float = 5.0) -> None:
    """Every process of the group (the TP workers) is gone, zombies reaped by init aside."""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"processes of group {pgid} are still alive {wait_s} s after the exit")
