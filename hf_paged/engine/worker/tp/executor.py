"""Tensor-parallel executor: rank 0's ModelRunner here, ranks 1..N-1 in spawned workers.

Every step rank 0 broadcasts the ModelInput through shared memory (``tp.workers.WorkerGroup``), then
runs it itself; the ranks meet in the collectives inside the forward pass (row-parallel
all_reduce, LM-head gather). A worker that dies or raises surfaces here as ``EngineDeadError``,
except at startup when it failed with rank 0's own error (a configuration every rank refuses
alike): that error is raised as a single rank raises it.

Ctrl-C: every rank must make the same collectives in the same order, so a KeyboardInterrupt in
the middle of rank 0's step would leave a worker waiting on collectives rank 0 never makes (and
the next step's mismatched sizes abort the process in gloo). So during a step (main thread, with
Python's default SIGINT handler) a first Ctrl-C is held until the step ends on every rank and
then raised: the engine stays usable. A second Ctrl-C in the same step, or any other
``BaseException`` escaping mid-step, interrupts at once; the workers are then stopped and later
calls raise a RuntimeError that says to create a new engine.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import traceback
import weakref

import torch

from hf_paged.distributed.communicator import Communicator
from hf_paged.distributed.process_group import create_process_group, reserve_port
from hf_paged.engine.core.contracts import ModelInput
from hf_paged.engine.runtime import RuntimeInfo
from hf_paged.engine.worker.model_runner import ModelRunner
from hf_paged.engine.worker.runner_output import RunnerOutput
from hf_paged.engine.worker.runner_spec import RunnerSpec
from hf_paged.engine.worker.tp.workers import EngineDeadError, WorkerGroup
from hf_paged.models.registry import tp_split_refusal


def rank_device(device: str, rank: int) -> str:
    """Rank r of an engine on ``cuda:N`` uses ``cuda:N+r``; CPU ranks share the CPU."""
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


def build_runner(
    rank: int, world_size: int, spec: RunnerSpec, address: str, abort_check=None, listen=None
):
    """Process group + ModelRunner for one rank (the WorkerGroup target factory).

    ``listen`` (rank 0): the store's listening socket from ``reserve_port`` (loopback only).
    """
    device = rank_device(spec.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    spec = dataclasses.replace(spec, device=device)
    pg = create_process_group(
        rank, world_size, address, "cuda" if device.startswith("cuda") else "cpu",
        abort_check=abort_check, listen_socket=listen,
    )  # fmt: skip
    return ModelRunner(spec, rank, Communicator(rank, world_size, pg))


def _raise_worker_failure(group: WorkerGroup, exc: Exception) -> None:
    """At startup, after rank 0 got ``exc``: raise ``EngineDeadError`` with a worker's error if
    one failed another way; return (the caller re-raises ``exc``) when the worker failed with
    rank 0's own error: one configuration fails every rank alike (a KV cache too small, a model
    the path refuses), and the caller then gets the error a single rank raises."""
    try:
        group.raise_if_dead(exc)
    except EngineDeadError as dead:
        own = "".join(traceback.format_exception_only(exc)).rstrip()
        if not (dead.worker_traceback or "").rstrip().endswith(own):
            raise


_LIVE: weakref.WeakSet = weakref.WeakSet()  # this process's executors, for the fork hook


def _keep_groups_in_fork() -> None:
    """An ``os.fork()``ed copy holds rank 0's process group of each engine, but not the threads
    its C++ store and gloo pairs run: destroying it there (the copy's exit) aborts the copy
    ('std::system_error: Invalid argument'). The copy never uses or frees it."""
    import ctypes

    for executor in list(_LIVE):
        group = getattr(getattr(executor, "runner", None), "comm", None)
        if group is not None and group.group is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group.group))


os.register_at_fork(after_in_child=_keep_groups_in_fork)


class TPExecutor:
    def __init__(self, runtime: RuntimeInfo, model):
        world = runtime.config.tensor_parallel_size
        if runtime.model_path is None:
            raise ValueError(
                f"tensor_parallel_size={world} needs a checkpoint directory as model (each rank "
                "loads only its shard), not an in-memory model"
            )
        if runtime.device.startswith("cuda"):
            base = int(runtime.device.split(":")[1])
            if base + world > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={world} is not allowed on {runtime.device}: only "
                    f"{torch.cuda.device_count()} CUDA devices"
                )
        problem = tp_split_refusal(runtime.hf_config, world, runtime.config.model_impl)
        if problem is not None:  # said before a worker starts (each would fail the same way)
            raise ValueError(problem)
        spec = RunnerSpec.from_runtime(runtime, runtime.model_path)
        # The store's socket is bound here, to 127.0.0.1 only (TCPStore alone would listen on
        # every interface), and handed over: no other process can take the port in between.
        listen = reserve_port("127.0.0.1")
        address = f"127.0.0.1:{listen.getsockname()[1]}"
        heartbeat = runtime.config.tp_heartbeat_timeout_s
        self._broken: str | None = None
        try:
            self.group = WorkerGroup(
                world, build_runner, spec, address, heartbeat_timeout=heartbeat
            )
        except BaseException:
            listen.close()
            raise
        try:
            self.runner = build_runner(0, world, spec, address, self.group.check, listen)
            self.group.wait_ready()
        except BaseException as exc:
            if listen.fileno() >= 0:  # not yet handed to the store
                listen.close()
            try:
                if isinstance(exc, Exception):
                    _raise_worker_failure(self.group, exc)
            finally:
                self.group.close()
                if getattr(self, "runner", None) is not None:  # built, a worker failed after
                    self.runner.exit()  # its memory goes back now, not when collected
            raise
        if runtime.device.startswith("cuda"):
            self.group.watch_process_group(self.runner.comm.group)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self._closed = False
        self._owner = os.getpid()  # a fork()ed copy must not close the parent's group
        _LIVE.add(self)

    def run(self, inp: ModelInput, sampling, external_rows) -> RunnerOutput:
        if self._broken is not None:
            raise RuntimeError(
                f"this tensor-parallel engine cannot run any more: {self._broken}, so its ranks "
                "are out of step and its workers were stopped. Create a new LLM / engine."
            )
        self.group.check()
        with _SigintHeld() as held:
            try:
                self.group.broadcast("run", inp)
                out = self.runner.run(inp, sampling, external_rows)
            except Exception as exc:
                self.group.raise_if_dead(exc)
                self._stop(f"rank 0 raised {type(exc).__name__} in the middle of a step")
                raise
            except BaseException as exc:
                self._stop(f"it was interrupted in the middle of a step ({type(exc).__name__})")
                raise
        held.raise_if_pending()  # every rank finished the step: safe to stop here
        return out

    def refresh_weights(self, weights: list) -> int:
        """Every rank copies its part of the full tensors ``weights`` (``(HF name, tensor)``),
        sent to the workers through the step channel (on the host), before any later step;
        rank 0's count of copies is returned."""
        if self._broken is not None:
            raise RuntimeError(f"this tensor-parallel engine cannot run any more: {self._broken}")
        self.runner.refresh_weights(weights, dry_run=True)  # a bad pair: no rank changes
        host = [(name, t.detach().cpu()) for name, t in weights]
        self.group.broadcast("refresh_weights", host)
        return self.runner.refresh_weights(weights)

    def _stop(self, reason: str) -> None:
        self._broken = reason
        self.group.close(timeout=1.0)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner:
            # a fork()ed copy (its LLM collected at exit): the workers, the process group and
            # its sockets are the parent's; leaving the group from here hung the copy
            return
        try:
            self.group.close()
        finally:
            self.runner.exit()  # its process group and sockets go now (see ModelRunner.exit)


class _SigintHeld:
    """Holds a first SIGINT until ``raise_if_pending``; a second one raises at once.

    Only on the main thread and while Python's default handler is installed; otherwise inert.
    """

    def __init__(self):
        self.pending = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
        return False

    def raise_if_pending(self) -> None:
        if self.pending:
            self.pending = False
            raise KeyboardInterrupt

    def _handler(self, signum, frame):
        if self.pending:
            raise KeyboardInterrupt
        self.pending = True
