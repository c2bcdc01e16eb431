"""Collectives over one engine's tensor-parallel group; every method is a no-op at world size 1.

The group is passed in explicitly (a backend object from ``process_group.create_process_group``;
no process-global default group is assumed), so two engines in one process never share one.
Collectives call the group's own methods (``group.allreduce([x], opts).wait()``): they need no
registration in ``torch.distributed``'s global tables and stay capturable in a CUDA graph (NCCL).
"""

from __future__ import annotations

import pickle

import torch
import torch.distributed as dist

from hf_paged.distributed.process_group import group_device

_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class Communicator:
    """Tensor-parallel collectives for one rank.

    Args:
        rank: this rank in the group.
        world_size: ranks in the group.
        group: the group's backend object (``ProcessGroupGloo`` / ``ProcessGroupNCCL``), or None
            at world size 1.

    Every rank must make the same collective calls in the same order. A peer that died makes
    the pending call raise RuntimeError (gloo: at once; NCCL: once the group is aborted).
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None):
        if world_size > 1 and group is None:
            raise ValueError(f"world_size={world_size} needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place sum (or "min"/"max") over ranks of a contiguous ``x``; returns ``x``."""
        if self.world_size == 1:
            return x
        if op not in _OPS:
            raise ValueError(f"op={op!r}: expected one of {sorted(_OPS)}")
        opts = dist.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        self.group.allreduce([x], opts).wait()
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; other ranks get None."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        opts = dist.GatherOptions()
        opts.rootRank = 0
        self.group.gather([parts] if parts is not None else [], [x], opts).wait()
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim on all ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj=None, src: int = 0):
        """Return ``src``'s picklable ``obj`` on every rank (two broadcasts: length, bytes)."""
        if self.world_size == 1:
            return obj
        device = group_device(self.group)
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if self.rank == src:
            data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
            size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
        else:
            size = torch.zeros(1, dtype=torch.int64, device=device)
        self.group.broadcast([size], opts).wait()
        if self.rank != src:
            data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        self.group.broadcast([data], opts).wait()
        return obj if self.rank == src else pickle.loads(data.cpu().numpy().tobytes())

    def barrier(self) -> None:
        """Return once every rank got here (a one-element all_reduce: same path on both backends)."""
        if self.world_size == 1:
            return
        self.all_reduce(torch.zeros(1, device=group_device(self.group)))
