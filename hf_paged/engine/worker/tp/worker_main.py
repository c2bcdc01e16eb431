"""The body of a tensor-parallel worker process (the ``WorkerGroup`` spawn target, see workers.py).

It arms its parent-death checks before anything else, starts its heartbeat, builds its target,
then runs every broadcast call until "exit".
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
import traceback

from hf_paged import envs
from hf_paged.engine.worker.tp.shm_broadcast import ShmReader
from hf_paged.engine.worker.tp.worker_health import set_parent_death_signal, start_beating


def worker_main(
    rank, world_size, factory, factory_args, handle, result_conn, poll_s, parent, heartbeat,
    environment,
) -> None:  # fmt: skip
    """Run worker ``rank`` until rank 0 sends "exit" or dies.

    ``parent`` is ``(rank 0's pid, whether it spawned this process from its main thread)``,
    taken by rank 0 before the spawn so that a parent already gone is noticed; ``heartbeat`` is
    ``(segment name, seconds between beats)``; ``environment`` is ``envs.worker_environment()``
    of rank 0, set before the target (and so its NCCL group) is built. Other arguments: see
    ``WorkerGroup``.
    """
    parent_pid, parent_is_main_thread = parent
    if parent_is_main_thread:
        set_parent_death_signal()
    if os.getppid() != parent_pid:  # rank 0 died while this process was starting
        os._exit(1)
    # Ctrl-C reaches the whole process group; only rank 0 handles it (it closes the group).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    threading.Thread(target=_exit_when_orphaned, args=(parent_pid, poll_s), daemon=True).start()
    start_beating(heartbeat[0], rank - 1, heartbeat[1])
    envs.set_environment(environment)
    try:
        reader = ShmReader(handle, poll_s, parent_pid)
        target = factory(rank, world_size, *factory_args)
        result_conn.send(("ready", None))
        while True:
            try:
                name, args, kwargs = reader.read()
            except EOFError:
                os._exit(1)  # rank 0 is gone: nobody to report to
            if name == "exit":
                if hasattr(target, "exit"):
                    target.exit()
                break
            getattr(target, name)(*args, **kwargs)
    except BaseException:
        text = traceback.format_exc()
        try:  # rank 0 raises it (EngineDeadError); print it only when it can't be sent
            result_conn.send(("error", text))
        except Exception:
            print(f"[hf_paged worker rank {rank}] {text}", file=sys.stderr, flush=True)
        # Exit at once: closing our sockets makes rank 0's pending collective fail promptly.
        os._exit(1)
    reader.close()
    result_conn.close()
    # Leave without the interpreter's module teardown, which takes about a second once torch is
    # loaded and would make every close() that slow; atexit handlers (library cleanup) still run.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _exit_when_orphaned(parent: int, poll_s: float) -> None:
    # Also covers a worker blocked inside a method (e.g. a collective that never returns).
    while os.getppid() == parent:
        time.sleep(poll_s)
    os._exit(1)
