"""Worker processes and shm IPC on CPU: gloo groups of 2 ranks, a dummy target per rank.

Spawning a worker costs seconds here (it imports torch), so one module fixture starts every
group (and the Ctrl-C parent process) at once and the tests share them.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hf_paged.distributed.process_group import find_free_port
from hf_paged.engine.worker.tp.shm_broadcast import ShmBroadcaster, ShmReader
from hf_paged.engine.worker.tp.workers import EngineDeadError, WorkerGroup
from hf_paged.testing.procfs import pid_alive
from tests.engine.worker.tp.dummy_target import DummyTarget

ROOT = Path(__file__).resolve().parents[4]
SHM = Path("/dev/shm")
pytestmark = pytest.mark.skipif(not SHM.is_dir(), reason="needs POSIX shared memory in /dev/shm")


def _gone(pids: list[int], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(pid_alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture(scope="module")
def fleet():
    """Groups "a", "b", "kill", "boom" (built and ready), "fail" (its worker raises in
    construction), and a parent process for the Ctrl-C test, all started concurrently."""
    sigint_parent = subprocess.Popen(
        [sys.executable, "-m", "tests.engine.worker.tp.dummy_target", "sigint"],
        cwd=ROOT,
        start_new_session=True,  # its own process group, as a shell job would be
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    groups, addresses = {}, {}
    rank0 = {}
    try:
        for name in ("a", "b", "kill", "boom", "fail"):
            addresses[name] = f"127.0.0.1:{find_free_port()}"
            groups[name] = WorkerGroup(
                2, DummyTarget, addresses[name], name == "fail", shm_capacity=64 * 1024
            )
        for name in ("a", "b", "kill", "boom"):
            rank0[name] = DummyTarget(0, 2, addresses[name], abort_check=groups[name].check)
            groups[name].wait_ready()  # as the engine: no deadline while the worker is alive
    except BaseException:  # a failed set-up must not leave the Ctrl-C parent or workers behind
        sigint_parent.kill()
        for group in groups.values():
            group.close()
        raise
    yield {"groups": groups, "rank0": rank0, "addresses": addresses, "sigint": sigint_parent}
    pids = [pid for group in groups.values() for pid in group.pids]
    names = [group.shm_name for group in groups.values()]
    for group in groups.values():
        group.close()
    for target in rank0.values():
        target.exit()
    if sigint_parent.poll() is None:
        sigint_parent.kill()
    assert _gone(pids) and not set(pids) & {p.pid for p in mp.active_children()}
    assert not [name for name in names if (SHM / name).exists()]


def test_broadcast_runs_method_on_worker(fleet):
    group, rank0 = fleet["groups"]["a"], fleet["rank0"]["a"]
    for value in (1.0, 2.5, -3.0):
        group.broadcast("add", value)
        assert rank0.add(value) == 2 * value  # the worker received the same argument
    group.broadcast("add", value=7.0)
    assert rank0.add(value=7.0) == 14.0
    group.check()


def test_communicator_collectives(fleet):
    group, rank0 = fleet["groups"]["a"], fleet["rank0"]["a"]
    obj = {"block_tables": [[1, 2, 3]], "eos": (2, 7)}
    group.broadcast("collectives", obj)
    out = rank0.collectives(obj)
    assert out["gather"].tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert out["all_gather"].tolist() == [[0.0, 0.0, 1.0, 1.0]]
    assert out["object_everywhere"]
    assert out["max"].tolist() == [1.0]


def test_message_larger_than_segment_arrives_intact(fleet):
    group, rank0 = fleet["groups"]["a"], fleet["rank0"]["a"]
    payload = os.urandom(8 << 20)  # 8 MiB through a 64 KiB segment
    digest = hashlib.sha256(payload).hexdigest()
    before = group.shm_name
    group.broadcast("check_payload", payload, digest)
    assert rank0.check_payload(payload, digest) == 1
    assert group.shm_name != before
    group.broadcast("add", 1.0)  # every reader has switched by now: the old segment is gone
    assert rank0.add(1.0) == 2.0
    assert not (SHM / before).exists()
    assert (SHM / group.shm_name).exists()


def test_segment_is_private_and_unpredictable(fleet):
    name = fleet["groups"]["a"].shm_name
    assert re.fullmatch(r"hfp_[0-9a-f]{24}", name)
    assert (SHM / name).stat().st_mode & 0o777 == 0o600
    names = {fleet["groups"][g].shm_name for g in ("a", "b", "kill", "boom", "fail")}
    assert len(names) == 5


def test_two_groups_in_one_process(fleet):
    a, b = fleet["groups"]["a"], fleet["groups"]["b"]
    a0, b0 = fleet["rank0"]["a"], fleet["rank0"]["b"]
    assert fleet["addresses"]["a"] != fleet["addresses"]["b"]
    a.broadcast("add", 1.0)
    b.broadcast("add", 10.0)
    assert b0.add(10.0) == 20.0
    assert a0.add(1.0) == 2.0


def test_shm_flow_control_and_growth_in_process():
    writer = ShmBroadcaster(1, capacity=1024)
    reader = ShmReader(writer.reader_handle(0), poll_s=0.05)
    try:
        writer.broadcast(("m", (1,), {}))
        with pytest.raises(TimeoutError):  # the reader has not taken message 1 yet
            writer.broadcast(("m", (2,), {}), timeout=0.05)
        assert reader.read() == ("m", (1,), {})
        big = bytes(range(256)) * 400  # 100 KiB > 1 KiB
        first = writer.name
        writer.broadcast(big)
        assert reader.read() == big
        writer.broadcast("small")
        assert reader.read() == "small"
        assert not (SHM / first).exists()
    finally:
        reader.close()
        writer.close()
        writer.close()
    assert not (SHM / writer.name).exists()


def test_worker_killed_during_collective(fleet):
    group, rank0 = fleet["groups"]["kill"], fleet["rank0"]["kill"]
    (pid,) = group.pids
    name = group.shm_name
    killed_at = []

    def kill_soon():
        time.sleep(0.5)  # rank 0 is blocked in the all_reduce by now
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    group.broadcast("slow_add", 60.0, 1.0)  # the worker sleeps before its all_reduce
    threading.Thread(target=kill_soon, daemon=True).start()
    with pytest.raises(EngineDeadError) as info:
        try:
            rank0.slow_add(60.0, 1.0)
        except Exception as exc:
            group.raise_if_dead(exc)
            raise
    assert time.monotonic() - killed_at[0] < 5.0
    assert info.value.rank == 1 and "exit code -9" in str(info.value)
    with pytest.raises(EngineDeadError):
        group.check()
    group.close()
    group.close()
    with pytest.raises(RuntimeError, match="closed"):
        group.broadcast("add", 1.0)
    assert _gone([pid])
    assert pid not in [p.pid for p in mp.active_children()]
    assert not (SHM / name).exists()


def test_worker_exception_carries_traceback(fleet):
    group, rank0 = fleet["groups"]["boom"], fleet["rank0"]["boom"]
    group.broadcast("boom")
    with pytest.raises(EngineDeadError) as info:
        try:
            rank0.add(1.0)  # the worker never joins: its exit ends this collective
        except Exception as exc:
            group.raise_if_dead(exc)
            raise
    assert info.value.rank == 1
    assert "ValueError: boom from worker" in str(info.value)
    assert "dummy_target.py" in info.value.worker_traceback
    assert isinstance(info.value.__cause__, RuntimeError)  # gloo's own error, kept as cause
    with pytest.raises(EngineDeadError, match="boom from worker"):
        group.broadcast("add", 1.0)


def test_worker_construction_failure(fleet):
    group = fleet["groups"]["fail"]
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match="dummy construction failed on purpose"):
        DummyTarget(0, 2, fleet["addresses"]["fail"], abort_check=group.check)
    with pytest.raises(EngineDeadError, match="dummy construction failed on purpose"):
        group.wait_ready(timeout=30)
    assert time.monotonic() - start < 30
    pids = group.pids
    group.close()
    assert _gone(pids)


def test_close_while_the_worker_starts_is_prompt():
    """A worker that is not ready yet (still importing, or waiting in the rendezvous a failed
    rank 0 never joins) cannot read "exit": close() terminates it at once. It waited out its
    5 s timeout first, so Ctrl-C while an engine started took 5 s to return."""
    group = WorkerGroup(2, DummyTarget, f"127.0.0.1:{find_free_port()}")
    pids = group.pids
    start = time.monotonic()
    group.close()
    assert time.monotonic() - start < 2.5
    assert _gone(pids)


def test_ctrl_c_in_parent_shuts_down_cleanly(fleet):
    parent = fleet["sigint"]
    line = parent.stdout.readline()  # "READY <shm name> <worker pid>"
    assert line.startswith("READY"), (line, parent.stderr.read() if parent.poll() else "")
    _, name, pid = line.split()
    time.sleep(0.3)  # the parent is looping over broadcasts and collectives
    os.killpg(parent.pid, signal.SIGINT)  # what Ctrl-C does to a foreground job
    parent.wait(timeout=20)
    stderr = parent.stderr.read()
    assert "KeyboardInterrupt" in stderr
    assert "hf_paged worker rank" not in stderr  # the worker ignored SIGINT, raised nothing
    assert _gone([int(pid)])
    assert not (SHM / name).exists()
