"""Fault scenarios at tensor_parallel_size=2 over gloo, each run in its own process.

``python -m tests.reliability.tp_scenarios SCENARIO MODEL_DIR`` prints one JSON line starting
with ``RESULT`` (what the test asserts on); ``test_tp_faults.py`` runs these under a hard time
limit, so a regression (a hang) fails the test instead of hanging CI.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

from hf_paged import LLM, SamplingParams
from hf_paged.engine.worker.tp.workers import EngineDeadError

ENGINE = dict(max_model_len=128, kv_block_size=8, num_kv_blocks=96, tensor_parallel_size=2)
SHORT = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
PROMPTS = [[5 + i, 17, 33 + i, 9] for i in range(6)]


def report(**values) -> None:
    print("RESULT " + json.dumps(values), flush=True)


def sem_entries() -> set[str]:
    """Named semaphores this process holds (other processes' entries do not count)."""
    from hf_paged.testing.procfs import shm_files

    return {f for f in shm_files(os.getpid()) if "/sem." in f}


def time_to_dead(llm: LLM, params: SamplingParams) -> tuple[float, EngineDeadError | None]:
    t0 = time.monotonic()
    try:
        for _ in range(50):
            llm.generate(PROMPTS, params, use_tqdm=False)
    except EngineDeadError as exc:
        return time.monotonic() - t0, exc
    return time.monotonic() - t0, None


def idle_kill(model: str) -> None:
    """Fault 1: a worker SIGKILLed while idle, then generate at once."""
    from tqdm import tqdm

    tqdm.get_lock()  # tqdm's own lock (a semaphore) lives as long as the process: not ours
    sems = sem_entries()
    llm = LLM(model, **ENGINE)
    llm.generate(PROMPTS, SHORT, use_tqdm=False)
    os.kill(llm.engine.executor.group.pids[0], signal.SIGKILL)
    seconds, err = time_to_dead(llm, SHORT)
    llm.close()
    leaked = sorted(sem_entries() - sems)
    report(dead=err is not None, seconds=seconds, rank=getattr(err, "rank", None), sems=leaked)


def stopped(model: str) -> None:
    """Fault 2: a worker SIGSTOPped (alive, not answering) during generate."""
    llm = LLM(model, tp_heartbeat_timeout_s=3.0, **ENGINE)
    llm.generate(PROMPTS, SHORT, use_tqdm=False)
    pid = llm.engine.executor.group.pids[0]
    os.kill(pid, signal.SIGSTOP)
    seconds, err = time_to_dead(llm, LONG)
    detail = str(err).splitlines()[0] if err else None
    llm.close()
    report(dead=err is not None, seconds=seconds, detail=detail)


def sigint(model: str) -> None:
    """Fault 3: Ctrl-C in the middle of generate, then generate again in the same process."""
    llm = LLM(model, **ENGINE)
    t0 = time.monotonic()
    ref = [o.token_ids for o in llm.generate(PROMPTS, LONG, use_tqdm=False)]
    call_s = time.monotonic() - t0
    interrupted = 0
    for fraction in (0.2, 0.5, 0.8):  # several landing points inside one call
        timer = threading.Timer(call_s * fraction, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            llm.generate(PROMPTS, LONG, use_tqdm=False)
        except KeyboardInterrupt:
            interrupted += 1
        try:
            timer.join()  # a signal that came late lands here, outside generate
        except KeyboardInterrupt:
            pass
    try:
        got = [o.token_ids for o in llm.generate(PROMPTS, LONG, use_tqdm=False)]
        outcome = "same" if got == ref else "different"
    except RuntimeError as exc:
        outcome = f"error: {exc}"
    llm.close()
    report(interrupted=interrupted, outcome=outcome, call_s=call_s)


def orphan(model: str) -> None:
    """Fault 4: this process is SIGKILLed by the test while the engine starts."""
    print("STARTING", flush=True)
    LLM(model, **ENGINE)
    print("STARTED", flush=True)
    time.sleep(60)


def _reader_main(handle) -> None:
    from hf_paged.engine.worker.tp.shm_broadcast import ShmReader

    reader = ShmReader(handle, poll_s=0.05)
    while True:
        reader.read()


def shm_reader_killed(_model: str) -> None:
    """Fault 1 at its root: a reader killed while it waits, then the writer broadcasts."""
    import multiprocessing as mp

    from hf_paged.engine.worker.tp.shm_broadcast import ShmBroadcaster

    ctx = mp.get_context("spawn")
    writer = ShmBroadcaster(1, 1024, ctx)
    proc = ctx.Process(target=_reader_main, args=(writer.reader_handle(0),), daemon=True)
    proc.start()
    if hasattr(writer, "release_reader_end"):
        writer.release_reader_end(0)
    writer.broadcast("first")
    time.sleep(3.0)  # the reader took it and waits for the next one
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    t0 = time.monotonic()
    errors = []
    for i in range(3):
        try:
            writer.broadcast(f"after kill {i}", timeout=5.0)
        except (ConnectionError, TimeoutError) as exc:
            errors.append(type(exc).__name__)
    writer.close()
    report(seconds=time.monotonic() - t0, errors=errors)


def security(model: str) -> None:
    """Fault 5: what the engine listens on and keeps in /dev/shm, before and after close(), and
    after a start that failed; what a bare ``os.fork()``ed copy's exit takes from it."""
    from hf_paged.testing.procfs import fd_targets, listening_sockets, shm_files

    _process_wide_state()
    base_fds = fd_targets(os.getpid())
    llm = LLM(model, **ENGINE)
    ref = [o.token_ids for o in llm.generate(PROMPTS, SHORT, use_tqdm=False)]
    fork_status = _fork_and_exit()
    same_after_fork = [o.token_ids for o in llm.generate(PROMPTS, SHORT, use_tqdm=False)] == ref
    pids = [os.getpid(), *llm.engine.executor.group.pids]
    listening = [addr for pid in pids for addr in listening_sockets(pid)]
    shm = sorted({f for pid in pids for f in shm_files(pid)})
    modes = {name: oct(os.stat(name).st_mode & 0o777) for name in shm}
    owners = {name: os.stat(name).st_uid == os.getuid() for name in shm}
    llm.close()
    after_fds = fd_targets(os.getpid())
    listening_after = listening_sockets(os.getpid())
    try:  # a start that fails on every rank alike (KV cache too small): nothing left either
        LLM(model, **dict(ENGINE, num_kv_blocks=1))
    except ValueError:
        pass
    report(
        fork_status=fork_status,
        same_after_fork=same_after_fork,
        listening=listening,
        modes=modes,
        owners=owners,
        shm_left=[name for name in shm if os.path.exists(name)],
        listening_after=listening_after,
        new_fds_after=sorted(set(after_fds) - set(base_fds)),
        failed_start_listening=listening_sockets(os.getpid()),
        failed_start_new_fds=sorted(set(fd_targets(os.getpid())) - set(base_fds)),
    )


def _fork_and_exit() -> int:
    """A bare fork() whose copy exits normally (its LLM collected there, exit hooks run); the
    copy's wait status. A copy that hangs ends by SIGALRM."""
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        sys.exit(0)
    return os.waitpid(pid, 0)[1]


def _process_wide_state() -> None:
    """Create what lives as long as the process, whoever uses it first: libuv's signal pipe
    (any TCPStore) and multiprocessing's resource tracker."""
    from datetime import timedelta
    from multiprocessing import resource_tracker

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=5))
    del store
    resource_tracker.ensure_running()


SCENARIOS = {
    f.__name__: f for f in (idle_kill, stopped, sigint, orphan, shm_reader_killed, security)
}

if __name__ == "__main__":
    name, model_dir = sys.argv[1], sys.argv[2]
    SCENARIOS[name](model_dir)
