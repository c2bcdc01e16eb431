"""Faults 1-5 and 7 of issue 14 at tensor_parallel_size=2 over gloo, each in a time-boxed process.

Each scenario of ``tp_scenarios.py`` runs in its own process group, all started at once by one
module fixture (a worker costs seconds to import torch); a scenario that outlives its limit is
killed and its test fails, so a regression shows as a failure, never as a hung CI job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hf_paged.testing import save_tiny_model
from hf_paged.testing.procfs import fd_targets, pid_alive

ROOT = Path(__file__).resolve().parents[2]
LIMIT_S = 300  # from the fixture start; the scenarios end in 10-40 s on 2 idle cores
CONCURRENT = ["idle_kill", "stopped", "sigint", "security", "shm_reader_killed"]
pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _spawn(args: list[str], **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, *args], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs,
    )  # fmt: skip


def _finish(proc: subprocess.Popen, limit: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the scenario and its workers
        out, err = proc.communicate()
        pytest.fail(f"timed out after {limit} s (a hang):\n{out}\n{err[-3000:]}")
    return proc.returncode, out, err


def _result(out: str) -> dict:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else {}


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("rel") / "llama"), seed=3)


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """Every scenario started now; ``runs(name)`` -> (returncode, result or stdout, stderr)."""
    t0 = time.monotonic()
    procs = {n: _spawn(["-m", "tests.reliability.tp_scenarios", n, model]) for n in CONCURRENT}
    script = tmp_path_factory.mktemp("guard") / "no_main_guard.py"
    script.write_text(NO_MAIN_GUARD.format(model=model))
    procs["no_main_guard"] = _spawn([str(script)])
    orphan: dict = {}
    watcher = threading.Thread(target=_orphan_run, args=(model, orphan), daemon=True)
    watcher.start()
    done: dict = {}

    def get(name):
        if name == "orphan":
            watcher.join(max(LIMIT_S - (time.monotonic() - t0), 1.0))
            return orphan
        if name not in done:
            left = LIMIT_S - (time.monotonic() - t0)
            code, out, err = _finish(procs[name], max(left, 1.0))
            done[name] = (code, out if name == "no_main_guard" else _result(out), err)
        return done[name]

    yield get
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


def test_shm_writer_never_blocks_on_a_killed_reader(runs):
    """Fault 1 at its root: with multiprocessing.Event the writer hung in Condition.notify()."""
    code, res, err = runs("shm_reader_killed")
    assert code == 0, err[-3000:]
    assert res["seconds"] < 5.0
    assert res["errors"] == ["ConnectionError"] * 3  # each broadcast names the gone reader


def test_worker_killed_while_idle_then_generate(runs):
    """Fault 1: EngineDeadError within seconds, no semaphore left once the engine is closed."""
    code, res, err = runs("idle_kill")
    assert code == 0, err[-3000:]
    assert res["dead"] and res["rank"] == 1
    assert res["seconds"] < 5.0
    assert res["sems"] == []


def test_stopped_worker_detected_by_heartbeat(runs):
    """Fault 2: SIGSTOP; tp_heartbeat_timeout_s=3 -> EngineDeadError naming the stall in ~3 s."""
    code, res, err = runs("stopped")
    assert code == 0, err[-3000:]
    assert res["dead"], res
    assert 2.5 < res["seconds"] < 15.0
    assert "no heartbeat" in res["detail"] and "tp_heartbeat_timeout_s" in res["detail"]


def test_ctrl_c_mid_generate_then_reuse(runs):
    """Fault 3: three Ctrl-Cs land inside generate; the next generate gives the same tokens."""
    code, res, err = runs("sigint")
    assert code == 0, err[-3000:]  # not 134 (gloo abort)
    assert "EnforceNotMet" not in err
    assert res["interrupted"] >= 1, res
    assert res["outcome"] == "same", res


def test_rendezvous_on_loopback_and_nothing_left_after_close(runs):
    """Fault 5: listening sockets loopback only, shm 0600 and unguessable, all freed by close()
    and by a start that failed; a fork()ed copy's exit takes none of it."""
    code, res, err = runs("security")
    assert code == 0, err[-3000:]
    assert res["listening"], "the engine's store and gloo sockets were not found"
    for address in res["listening"]:
        host = address.rsplit(":", 1)[0]
        assert host in ("127.0.0.1", "::1"), f"{address} is reachable from other hosts"
    assert res["modes"] and set(res["modes"].values()) == {"0o600"}
    assert all(res["owners"].values())
    for name in res["modes"]:
        assert len(name.rsplit("_", 1)[-1]) == 24  # 96 random bits
    assert res["shm_left"] == [] and res["listening_after"] == []
    assert res["new_fds_after"] == []
    # a failed start gives its sockets back at once, not when a collection breaks the cycle of
    # the error's frames (its half-built runner held the store and gloo sockets)
    assert res["failed_start_listening"] == [] and res["failed_start_new_fds"] == []
    # a bare fork()ed copy exits cleanly and leaves the parent's workers running (its exit
    # SIGTERMed them through multiprocessing's table of children, then hung leaving the group)
    assert res["fork_status"] == 0 and res["same_after_fork"]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                cmd = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid and b"spawn_main" in cmd:
                out.append(int(entry))
    return out


def _orphan_run(model: str, result: dict) -> None:
    # Kill the parent as soon as its first worker exists: the worker is still importing torch.
    # No pipes: an orphan would hold them open (communicate() would wait on it).
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    args = [sys.executable, "-m", "tests.reliability.tp_scenarios", "orphan", model]
    parent = subprocess.Popen(args, cwd=ROOT, env=_env(), start_new_session=True, **quiet)
    deadline = time.monotonic() + LIMIT_S / 2
    workers: list[int] = []
    while not workers and time.monotonic() < deadline and parent.poll() is None:
        workers = _children(parent.pid)
        time.sleep(0.02)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    t0 = time.monotonic()
    # It notices once spawn has imported the main module (torch): seconds on idle cores.
    while any(pid_alive(p) for p in workers) and time.monotonic() - t0 < 90:
        time.sleep(0.1)
    result["workers"] = workers
    result["alive"] = [p for p in workers if pid_alive(p)]
    result["seconds"] = time.monotonic() - t0
    for pid in result["alive"]:
        os.kill(pid, signal.SIGKILL)


def test_worker_exits_when_parent_killed_during_startup(runs):
    """Fault 4: the parent dies while its worker still imports; the worker must not linger."""
    res = runs("orphan")
    assert res.get("workers"), "no worker appeared"
    assert res["alive"] == [], "a worker outlived its dead parent"


NO_MAIN_GUARD = """
import json
from hf_paged import LLM
from hf_paged.engine.worker.tp.workers import EngineDeadError
try:
    LLM({model!r}, tensor_parallel_size=2, max_model_len=64)
except EngineDeadError as exc:
    print("CAUGHT " + json.dumps(str(exc)), flush=True)
"""


def test_worker_startup_failure_carries_its_error(runs):
    """Fault 7: a script without ``if __name__ == "__main__":`` -> the worker's own error."""
    code, out, err = runs("no_main_guard")
    caught = [json.loads(line[7:]) for line in out.splitlines() if line.startswith("CAUGHT ")]
    assert caught, (out, err[-3000:])
    assert "bootstrapping phase" in caught[0]  # spawn's own explanation, from the worker
    assert "__main__" in caught[0]


def test_fd_helper_sees_sockets():
    """The /proc reader itself: a listening socket of this process is found."""
    import socket

    from hf_paged.testing.procfs import listening_sockets

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert f"127.0.0.1:{port}" in listening_sockets(os.getpid())
    assert any(t.startswith(("pipe:", "/", "socket:")) for t in fd_targets(os.getpid()))
