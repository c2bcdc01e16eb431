"""Rank 0 -> worker processes for tensor parallelism: spawn, dispatch, death watch, shutdown.

Rank 0 writes ``(method_name, args, kwargs)`` through a ``ShmBroadcaster`` (shm_broadcast.py):
each worker waits on its event, reads, and calls the method on its own target object (its
ModelRunner). Rank 0 does not wait for the methods to
finish: they take part in collectives with rank 0, which synchronise the ranks by themselves.

Failure handling, in one place:
- a worker whose construction or method raises sends its traceback through its result pipe and
  exits; the exit closes its gloo sockets, so rank 0's pending collective raises at once;
- a watchdog thread on rank 0 waits on the workers' sentinels; on the first death it aborts the
  registered process groups (NCCL) and kills the surviving workers, which ends any collective
  rank 0 is blocked in (gloo raises when a peer's sockets close, not on ``abort``);
- the watchdog also reads each worker's heartbeat (``worker_health.Heartbeats``) and kills a
  worker that stopped beating for ``heartbeat_timeout`` seconds (SIGSTOPped, wedged): its closed
  sockets end rank 0's collective, which then raises ``EngineDeadError`` naming the stall;
- a worker that dies before it could report (e.g. while spawn imports the main module) leaves
  its stderr tail, which rank 0 keeps (``worker_health.StderrTail``) and puts in the error;
- rank 0 turns any exception in a step into ``EngineDeadError`` with ``raise_if_dead``;
- workers ignore SIGINT and leave when rank 0 sends "exit", or when rank 0 dies: at once through
  ``PR_SET_PDEATHSIG`` (Linux), EOF on their socket, or within ``poll_s`` by polling the parent
  pid that rank 0 passed in the spawn arguments (known before the worker runs any code).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field

from hf_paged import envs
from hf_paged.engine.worker.tp.shm_broadcast import ShmBroadcaster, ShmReader, ShmReaderHandle
from hf_paged.engine.worker.tp.worker_health import EngineDeadError, Heartbeats, StderrTail
from hf_paged.engine.worker.tp.worker_main import worker_main

__all__ = ["EngineDeadError", "ShmBroadcaster", "ShmReader", "ShmReaderHandle", "WorkerGroup"]

# Every live worker process of this process's groups, for the fork hook below.
_WORKER_PROCS: weakref.WeakSet = weakref.WeakSet()


def _forget_workers_in_fork() -> None:
    """In an ``os.fork()``ed copy of rank 0 the workers are the parent's: multiprocessing's exit
    hook there would SIGTERM them (daemons in its table of children, copied by the fork) and
    then fail to join them. mp's own forked children reset that table; a bare fork does not."""
    from multiprocessing import process

    for proc in list(_WORKER_PROCS):
        process._children.discard(proc)


os.register_at_fork(after_in_child=_forget_workers_in_fork)


@dataclass
class _GroupState:
    """Everything shutdown and the watchdog touch; holds no reference to the WorkerGroup."""

    shm: ShmBroadcaster
    heartbeats: Heartbeats
    heartbeat_interval: float
    tails: dict = field(default_factory=dict)  # rank -> StderrTail
    stalled: dict = field(default_factory=dict)  # rank -> seconds without a heartbeat
    procs: dict = field(default_factory=dict)  # rank -> Process
    pids: list = field(default_factory=list)  # of the workers, in rank order
    conns: dict = field(default_factory=dict)  # rank -> rank 0's end of the result pipe
    ready: set = field(default_factory=set)
    reports: dict = field(default_factory=dict)  # rank -> traceback text
    deaths: list = field(default_factory=list)  # ranks, in the order the watchdog saw them die
    killed: set = field(default_factory=set)  # ranks the watchdog killed itself
    abort_pgs: list = field(default_factory=list)
    closing: threading.Event = field(default_factory=threading.Event)
    stop_pipe: tuple = field(default_factory=os.pipe)  # a byte here stops the watchdog
    watchdog: threading.Thread | None = None
    owner: int = field(default_factory=os.getpid)  # a forked copy of rank 0 must not shut down


class WorkerGroup:
    """Ranks 1..world_size-1 as spawned processes that mirror rank 0's method calls.

    Each worker runs ``target = target_factory(rank, world_size, *factory_args)`` (a picklable
    top-level callable), reports "ready" or its traceback, then dispatches every broadcast
    ``(name, args, kwargs)`` as ``getattr(target, name)(*args, **kwargs)``; "exit" calls
    ``target.exit()`` if present and ends the process. Rank 0 builds its own target separately,
    after constructing the group and before ``wait_ready`` (construction is collective).

    NVLink multicast stays off: ``envs.WORKER_ENV_DEFAULTS`` not set in rank 0's environment
    are set there (for rank 0's own NCCL group) and in every worker before its target is built.

    On rank 0::

        address = f"127.0.0.1:{find_free_port()}"
        group = WorkerGroup(world_size, ModelRunner, spec, address)   # spawns, returns at once
        runner = ModelRunner(0, world_size, spec, address, abort_check=group.check)
        group.wait_ready()
        group.broadcast("run", step_input)      # the workers start the step ...
        try:
            output = runner.run(step_input)     # ... and rank 0 runs it; collectives sync them
        except Exception as exc:
            group.raise_if_dead(exc)            # EngineDeadError with the worker's traceback
            raise
        group.close()

    Args:
        world_size: ranks in all, rank 0 included (>= 2).
        target_factory: ``factory(rank, world_size, *factory_args) -> object``.
        shm_capacity: initial payload bytes of the shared-memory segment (it grows on demand).
        poll_s: how often an idle worker checks that rank 0 is alive.
        heartbeat_timeout: seconds without a worker heartbeat before the worker counts as stuck
            and is killed (the pending step then raises EngineDeadError); None = never.
        heartbeat_interval: seconds between a worker's heartbeats.
    """

    def __init__(
        self,
        world_size: int,
        target_factory,
        *factory_args,
        shm_capacity: int = 1 << 20,
        poll_s: float = 0.5,
        heartbeat_timeout: float | None = 45.0,
        heartbeat_interval: float = 0.5,
    ):
        if world_size < 2:
            raise ValueError(f"world_size={world_size}: a WorkerGroup needs at least 2 ranks")
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        shm = ShmBroadcaster(world_size - 1, shm_capacity, ctx)
        beats = Heartbeats(world_size - 1, heartbeat_timeout)
        self._st = st = _GroupState(
            shm=shm, heartbeats=beats, heartbeat_interval=heartbeat_interval
        )
        self._finalizer = weakref.finalize(self, _shutdown, st, 5.0)
        atexit.register(self._finalizer)  # runs before multiprocessing's own atexit hook
        # PR_SET_PDEATHSIG fires when the spawning *thread* exits: only safe from the main thread.
        parent = (os.getpid(), threading.current_thread() is threading.main_thread())
        environment = envs.worker_environment()
        envs.set_environment(environment)
        for rank in range(1, world_size):
            recv, send = ctx.Pipe(duplex=False)
            args = (rank, world_size, target_factory, factory_args, shm.reader_handle(rank - 1))
            args += (send, poll_s, parent, (beats.name, heartbeat_interval), environment)
            proc = ctx.Process(
                target=worker_main, args=args, name=f"hf_paged-tp{rank}", daemon=True
            )
            st.tails[rank] = StderrTail()
            with _sigint_blocked():  # no KeyboardInterrupt before the worker ignores SIGINT
                st.tails[rank].start_child(proc.start)
            send.close()  # so that rank 0 sees EOF when the worker is gone
            shm.release_reader_end(rank - 1)  # likewise for the worker's shm socket
            st.procs[rank], st.conns[rank] = proc, recv
            _WORKER_PROCS.add(proc)
            st.pids.append(proc.pid)
        st.watchdog = threading.Thread(
            target=_watchdog, args=(st,), name="hf_paged-watchdog", daemon=True
        )
        st.watchdog.start()

    @property
    def pids(self) -> list[int]:
        return list(self._st.pids)

    @property
    def shm_name(self) -> str:
        """The shared-memory segment in use now (changes when a message outgrows it)."""
        return self._st.shm.name

    def watch_process_group(self, pg) -> None:
        """Abort ``pg`` (rank 0's group) as soon as a worker dies, so NCCL calls end."""
        self._st.abort_pgs.append(pg)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Block until every worker built its target.

        Raises:
            EngineDeadError: a worker's construction failed (with its traceback) or it died.
            TimeoutError: not all ready within ``timeout`` seconds.
        """
        st = self._st
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.check()
            if len(st.ready) == len(st.procs):
                return
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(f"workers {sorted(set(st.procs) - st.ready)} not ready")
            mp_connection.wait(self._waitables(), timeout=left)

    def broadcast(self, name: str, *args, **kwargs) -> None:
        """Have every worker call ``target.name(*args, **kwargs)``; does not wait for them.

        Raises:
            EngineDeadError: a worker has died or raised.
            RuntimeError: the group is closed.
        """
        if self._st.closing.is_set():
            raise RuntimeError("WorkerGroup is closed")
        if len(self._st.ready) < len(self._st.procs):
            self.wait_ready()
        self.check()
        try:
            self._st.shm.broadcast((name, args, kwargs), check=self.check)
        except ConnectionError as exc:  # a worker's socket closed: it is gone
            self.raise_if_dead(exc)
            raise

    def check(self) -> None:
        """Raise EngineDeadError if any worker died or reported an exception (non-blocking)."""
        error = self._failure()
        if error is not None:
            try:
                raise error
            finally:
                error = None  # its traceback holds this frame: no cycle through the local

    def raise_if_dead(self, exc: BaseException, timeout: float = 2.0) -> None:
        """After rank 0 got ``exc`` in a step: raise EngineDeadError from it if a worker failed.

        Waits up to ``timeout`` seconds for a worker's traceback or death; returns (so the
        caller re-raises ``exc``) when every worker still looks healthy.
        """
        deadline = time.monotonic() + timeout
        while True:
            error = self._failure()
            if error is not None:
                try:
                    raise error from exc
                finally:
                    # its traceback holds this frame: no cycle keeping it, ``exc`` and the
                    # frames (a half-built runner, its process group's sockets) until a collection
                    error = None
            left = deadline - time.monotonic()
            if left <= 0:
                return
            mp_connection.wait(self._waitables(), timeout=left)

    def close(self, timeout: float = 5.0) -> None:
        """Send "exit", join, then terminate/kill stragglers and unlink shm. Idempotent."""
        found = self._finalizer.detach()
        if found is not None:
            atexit.unregister(self._finalizer)
            _shutdown(self._st, timeout)

    def _waitables(self) -> list:
        st = self._st
        conns = [conn for conn in st.conns.values() if not conn.closed]
        return conns + [p.sentinel for r, p in st.procs.items() if r not in st.deaths]

    def _failure(self) -> EngineDeadError | None:
        st = self._st
        _drain(st)
        if st.closing.is_set():
            return None
        exited = [r for r, p in st.procs.items() if p.exitcode is not None]  # (not closed yet)
        first = [r for r in st.deaths if r not in st.killed]
        failed = first + [
            r for r in [*st.reports, *exited] if r not in first and r not in st.killed
        ]
        if not failed:
            return None
        rank = failed[0]
        proc = st.procs[rank]
        if rank in st.deaths and proc.exitcode is None:
            proc.join(1.0)  # its sentinel fired: reap it so the exit code is known
        code = proc.exitcode
        if rank in st.stalled:
            detail = (
                f"stopped responding: no heartbeat for {st.stalled[rank]:.1f} s (more than "
                f"tp_heartbeat_timeout_s={st.heartbeats.timeout}), so it was killed"
            )
        elif code is None:
            detail = "raised an exception"
        else:
            detail = f"died (exit code {code})"
        others = sorted(set(failed[1:]))
        if others:
            detail += f"; ranks {others} failed after it"
        text = st.reports.get(rank)
        if text is None and rank not in st.stalled:  # no report: its last words on stderr
            tail = st.tails[rank].text(wait=0.5) if rank in st.tails else ""
            text = f"(no report; the worker's stderr ended with)\n{tail}" if tail else None
        return EngineDeadError(rank, text, detail)


def _drain(st: _GroupState) -> None:
    """Take the workers' pending "ready" and error reports off their result pipes."""
    for rank, conn in st.conns.items():
        try:
            while not conn.closed and conn.poll():
                kind, text = conn.recv()
                if kind == "ready":
                    st.ready.add(rank)
                else:
                    st.reports.setdefault(rank, text)
        except (EOFError, OSError):
            conn.close()


def _watchdog(st: _GroupState) -> None:
    alive = {proc.sentinel: rank for rank, proc in st.procs.items()}
    stop = st.stop_pipe[0]
    every = st.heartbeat_interval if st.heartbeats.timeout is not None else None
    while alive:
        ready = mp_connection.wait([*alive, stop], timeout=every)
        if stop in ready or st.closing.is_set():
            return
        for sentinel in ready:
            st.deaths.append(alive.pop(sentinel))
        if not ready:  # a time-out: look for workers that stopped beating
            stuck = {i + 1: s for i, s in st.heartbeats.stale() if i + 1 in alive.values()}
            st.stalled.update(stuck)
            for rank in stuck:
                st.procs[rank].kill()  # a stopped process still takes SIGKILL
            continue  # its sentinel fires next: handled as a death, as the first failure
        # The group is broken: end every collective rank 0 may be blocked in. NCCL: abort.
        # gloo: abort does not end a pending wait, a peer's closed sockets do -- kill the rest.
        for pg in st.abort_pgs:
            from hf_paged.distributed.process_group import abort_process_group

            with contextlib.suppress(Exception):
                abort_process_group(pg)
        for rank in alive.values():
            if not st.closing.is_set():
                st.killed.add(rank)
                st.procs[rank].kill()


def _shutdown(st: _GroupState, timeout: float) -> None:
    if os.getpid() != st.owner:  # e.g. a fork()ed DataLoader worker collecting its copy
        return
    st.closing.set()
    with contextlib.suppress(OSError):
        os.write(st.stop_pipe[1], b"x")
    deadline = time.monotonic() + timeout
    procs = list(st.procs.values())
    _drain(st)
    # A worker still starting (not "ready": e.g. Ctrl-C or a failure in rank 0 while the
    # workers load) never reads "exit": it is terminated at once, not after ``timeout``.
    if procs and len(st.ready) == len(procs) and all(p.is_alive() for p in procs):
        with contextlib.suppress(Exception):  # a busy or wedged worker: terminated below
            st.shm.broadcast(("exit", (), {}), timeout=timeout / 2)
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(1.0)
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
        with contextlib.suppress(ValueError):  # still running after kill: keep its sentinel
            proc.close()  # frees the sentinel descriptor now, not when collected
    st.shm.close()
    st.heartbeats.close()
    for conn in st.conns.values():
        conn.close()
    for tail in st.tails.values():
        tail.text(wait=1.0)  # its thread ends at the worker's EOF and closes the pipe
    if st.watchdog is not None and st.watchdog is not threading.current_thread():
        st.watchdog.join(1.0)  # it has seen the stop byte; join before its fd is closed
    for fd in st.stop_pipe:
        with contextlib.suppress(OSError):
            os.close(fd)


@contextlib.contextmanager
def _sigint_blocked():
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield  # a child started here inherits the mask: SIGINT stays pending, then ignored
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
