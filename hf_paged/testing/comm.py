"""Tensor-parallel ranks without a process group: a fake communicator for one rank's sharding
math, and threads that run every rank's model with collectives through a barrier."""

from __future__ import annotations

import torch

from hf_paged.distributed.communicator import Communicator


class FakeComm(Communicator):
    """Rank ``rank`` of ``world_size`` without a process group: collectives return the local
    tensor, so a test can check sharding and combine per-rank results itself."""

    def __init__(self, rank: int, world_size: int):
        super().__init__(rank, world_size, group=object())

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ThreadGroup:
    """Lets ``world_size`` threads run one model each as TP ranks, collectives via a barrier.

    ``ThreadGroup(n).comms()`` gives one ``ThreadComm`` per rank; run each rank's forward in its
    own thread (torch ops release the GIL). A CPU stand-in for a real process group in tests.
    """

    def __init__(self, world_size: int):
        import threading

        self.world_size = world_size
        self.barrier = threading.Barrier(world_size, timeout=60)
        self.slots: list[torch.Tensor | None] = [None] * world_size

    def comms(self) -> list[ThreadComm]:
        return [ThreadComm(self, r) for r in range(self.world_size)]

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read them
        return parts


class ThreadComm(Communicator):
    def __init__(self, group: ThreadGroup, rank: int):
        super().__init__(rank, group.world_size, group=group)

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        stacked = torch.stack(self.group.exchange(self.rank, x))
        reduced = {"sum": stacked.sum, "min": stacked.amin, "max": stacked.amax}[op](0)
        return x.copy_(reduced)

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        parts = self.group.exchange(self.rank, x)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.group.exchange(self.rank, x), dim=-1)


def run_ranks(fn, world_size: int) -> list:
    """Call ``fn(rank)`` in one thread per rank; returns the results in rank order."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(world_size) as pool:
        return list(pool.map(fn, range(world_size)))
