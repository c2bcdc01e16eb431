"""A stand-in for ModelRunner in the IPC tests: each method does gloo collectives with rank 0.

Also a tiny parent program for the Ctrl-C test: ``python -m tests.tp.dummy_target sigint``.
"""

from __future__ import annotations

import hashlib
import sys
import time

import torch

from hf_paged.distributed.communicator import Communicator
from hf_paged.distributed.process_group import (
    create_process_group,
    destroy_process_group,
    find_free_port,
)


class DummyTarget:
    """``DummyTarget(rank, world_size, init_address, fail_in_init=False)`` is the factory."""

    def __init__(self, rank, world_size, init_address, fail_in_init=False, abort_check=None):
        if fail_in_init and rank != 0:
            raise ValueError("dummy construction failed on purpose")
        self.rank = rank
        # the engine's start (engine/worker/tp/executor.py): the store's default timeout, so rank 0
        # waits for workers that are alive but slow to import torch (a loaded machine takes
        # minutes), while abort_check ends the wait at once when one of them dies
        self.pg = create_process_group(
            rank, world_size, init_address, "cpu", abort_check=abort_check
        )
        self.comm = Communicator(rank, world_size, self.pg)

    def add(self, value: float = 1.0) -> float:
        """Sum of ``value`` over ranks: proves every rank received the same argument."""
        t = torch.tensor([float(value)])
        self.comm.all_reduce(t)
        return t.item()

    def slow_add(self, delay: float, value: float = 1.0) -> float:
        if self.rank != 0:
            time.sleep(delay)
        return self.add(value)

    def check_payload(self, payload: bytes, digest: str) -> int:
        """1 on every rank iff every rank's payload hashes to ``digest``."""
        ok = torch.tensor([int(hashlib.sha256(payload).hexdigest() == digest)])
        self.comm.all_reduce(ok, op="min")
        return int(ok.item())

    def collectives(self, obj) -> dict:
        """Every Communicator collective once; rank r contributes ``[r, r]``."""
        x = torch.full((1, 2), float(self.rank))
        self.comm.barrier()
        received = self.comm.broadcast_object(obj if self.rank == 0 else None)
        same = self.comm.all_reduce(torch.tensor([int(received == obj)]), op="min")
        return {
            "gather": self.comm.gather_last_dim(x),
            "all_gather": self.comm.all_gather_last_dim(x),
            "object_everywhere": bool(same.item()),
            "max": self.comm.all_reduce(torch.tensor([float(self.rank)]), op="max"),
        }

    def boom(self) -> None:
        if self.rank != 0:
            raise ValueError("boom from worker")

    def exit(self) -> None:
        destroy_process_group(self.pg)
        self.pg = None


def env_probe(rank, world_size, path):
    """A WorkerGroup factory that writes the worker's ``envs.WORKER_ENV_DEFAULTS`` variables
    (None = unset) to ``path`` as JSON, as its environment holds them when its target is built."""
    import json
    import os

    from hf_paged import envs

    seen = {name: os.environ.get(name) for name in envs.WORKER_ENV_DEFAULTS}
    with open(path, "w") as f:
        json.dump(seen, f)
    return object()


def _sigint_parent() -> None:
    from hf_paged.engine.worker.tp.workers import WorkerGroup

    address = f"127.0.0.1:{find_free_port()}"
    group = WorkerGroup(2, DummyTarget, address)
    rank0 = DummyTarget(0, 2, address, abort_check=group.check)
    group.wait_ready()  # as the engine: no deadline while the worker is alive
    print("READY", group.shm_name, *group.pids, flush=True)
    while True:  # a Ctrl-C lands in the middle of a broadcast or a collective
        group.broadcast("add", 1.0)
        rank0.add(1.0)


if __name__ == "__main__":
    if sys.argv[1:] == ["sigint"]:
        _sigint_parent()
