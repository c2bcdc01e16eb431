"""hf_paged.shard_generate: exactly-once parquet parts over launcher ranks, kill and resume,
torchrun, and a tp=2 engine inside a torchrun rank (its own group, beside the launcher's)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

pq = pytest.importorskip("pyarrow.parquet")
datasets = pytest.importorskip("datasets")

from hf_paged.entrypoints.torchrun import shard_generate  # noqa: E402
from tests.entrypoints.scale_utils import (  # noqa: E402
    ENGINE,
    GREEDY,
    SAMPLED,
    make_model,
    reference,
    text_prompts,
)

TARGET = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_target.py")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(TARGET)))
N_ROWS = 40
TIMEOUT_S = 180  # a regression fails the test instead of hanging CI


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard")
    model = make_model(root)
    prompts = text_prompts(N_ROWS, seed=4)
    data = str(root / "prompts.parquet")
    datasets.Dataset.from_dict({"prompt": prompts}).to_parquet(data)
    ref = reference(model, prompts, list(range(N_ROWS)), GREEDY)
    return model, data, prompts, ref


def read_parts(out_dir) -> dict:
    """id -> generated ids over every part; fails on a duplicate row or a stray temporary."""
    names = sorted(os.listdir(out_dir))
    assert [n for n in names if ".tmp-" in n] == [], "a temporary file was left behind"
    rows = [r for n in names if n.endswith(".parquet")
            for r in pq.read_table(os.path.join(out_dir, n)).to_pylist()]  # fmt: skip
    dupes = [k for k, c in Counter(r["id"] for r in rows).items() if c > 1]
    assert dupes == [], f"rows {dupes} were written twice"
    return {r["id"]: r["generation_token_ids"] for r in rows}


def launch(setup, out, rank, world=2, extra=()):
    model, data, _, _ = setup
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), PYTHONPATH=REPO,
               OMP_NUM_THREADS="1")  # fmt: skip
    cmd = [sys.executable, TARGET, "--data", data, "--out", str(out), "--model", model,
           "--report", str(out) + ".report-{rank}.json", *extra]  # fmt: skip
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(proc) -> None:
    out, _ = proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode == 0, out.decode()[-3000:]


def report(out, rank) -> dict:
    with open(f"{out}.report-{rank}.json") as f:
        return json.load(f)


def test_in_process_resume_and_layout_check(setup, tmp_path):
    model, data, _, ref = setup
    out = tmp_path / "parts"
    r0 = shard_generate(data, str(out), model=model, rank=0, world_size=2, rows_per_part=8,
                        sampling_params=GREEDY, **ENGINE)  # fmt: skip
    assert r0.rows_generated == N_ROWS // 2 and len(r0.written) == 3 and r0.skipped == []
    os.remove(r0.written[1])  # as if the run had died before this part
    again = shard_generate(data, str(out), model=model, rank=0, world_size=2, rows_per_part=8,
                           sampling_params=GREEDY, **ENGINE)  # fmt: skip
    assert again.written == [r0.written[1]] and again.rows_generated == 8
    assert len(again.skipped) == 2
    r1 = shard_generate(data, str(out), model=model, rank=1, world_size=2, rows_per_part=8,
                        sampling_params=GREEDY, **ENGINE)  # fmt: skip
    assert read_parts(out) == ref
    with pytest.raises(ValueError, match="world_size"):
        shard_generate(data, str(out), model=model, rank=0, world_size=4, rows_per_part=8)
    assert r1.rank == 1


def test_sampled_rows_same_whatever_the_split(setup, tmp_path):
    """Row-id seeds: 3 ranks of sampling give the single-process sampled tokens."""
    model, data, prompts, _ = setup
    for rank in range(3):
        shard_generate(data, str(tmp_path), model=model, rank=rank, world_size=3,
                       rows_per_part=5, sampling_params=SAMPLED, seed=11, **ENGINE)  # fmt: skip
    assert read_parts(tmp_path) == reference(model, prompts, list(range(N_ROWS)), SAMPLED, 11)


def test_bad_arguments_name_themselves(setup, tmp_path, monkeypatch):
    model, data, _, _ = setup
    with pytest.raises(ValueError, match=r"rank=2, world_size=2"):
        shard_generate(data, str(tmp_path), model=model, rank=2, world_size=2)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        shard_generate(data, str(tmp_path), model=model, rank=0)
    with pytest.raises(ValueError, match="column"):
        shard_generate(data, str(tmp_path), model=model, column="text", rank=0, world_size=1)
    with pytest.raises(ValueError, match="rows_per_part=0"):
        shard_generate(data, str(tmp_path), model=model, rows_per_part=0, rank=0, world_size=1)


def test_two_ranks_one_killed_then_rerun(setup, tmp_path):
    _, _, _, ref = setup
    out = tmp_path / "parts"
    parts = ["--rows-per-part", "2"]  # rank 1: 10 parts of 2 rows
    p0 = launch(setup, out, 0, extra=parts)
    p1 = launch(setup, out, 1, extra=[*parts, "--sleep-per-part", "0.5"])
    deadline = time.monotonic() + TIMEOUT_S
    while not _parts(out, 1) and time.monotonic() < deadline:
        assert p1.poll() is None, p1.communicate()[0].decode()[-3000:]
        time.sleep(0.02)
    p1.send_signal(signal.SIGKILL)
    p1.communicate(timeout=TIMEOUT_S)
    finish(p0)
    done_before = len(_parts(out, 1))
    assert 1 <= done_before < 10, "rank 1 was not killed mid-run"
    p0, p1 = launch(setup, out, 0, extra=parts), launch(setup, out, 1, extra=parts)
    finish(p0)
    finish(p1)
    assert report(out, 0)["rows_generated"] == 0  # rank 0 had finished: nothing redone
    r1 = report(out, 1)
    assert len(r1["skipped"]) == done_before
    assert r1["rows_generated"] == 2 * (10 - done_before)
    assert read_parts(out) == ref


def test_torchrun_with_a_tp2_engine_in_one_rank(setup, tmp_path):
    """torchrun sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; the script also opens the
    launcher's default gloo group. Rank 1's tp=2 engine still forms its own group."""
    model, data, _, ref = setup
    out = tmp_path / "parts"
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "2", TARGET, "--data", data,
           "--out", str(out), "--model", model, "--report", str(out) + ".report-{rank}.json",
           "--tp-rank", "1", "--user-group"]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        env.pop(key, None)
    proc = subprocess.run(cmd, env=env, capture_output=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, (proc.stdout + proc.stderr).decode()[-4000:]
    r0, r1 = report(out, 0), report(out, 1)
    assert (r0["tp"], r0["tp_workers"]) == (1, 0)
    assert (r1["tp"], r1["tp_workers"]) == (2, 1)  # its own spawned rank-1 worker
    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["rows_generated"] + r1["rows_generated"] == N_ROWS
    assert read_parts(out) == ref


def _parts(out, rank) -> list[str]:
    if not os.path.isdir(out):
        return []
    return [n for n in os.listdir(out) if n.startswith(f"part-{rank:05d}-")]
