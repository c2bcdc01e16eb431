"""Collectives over one engine's tensor-parallel group; every method is a no-op at world size 1.

The group is passed in explicitly (no process-global default group is assumed), so two engines in
one process never share one.
"""

from __future__ import annotations

import torch


class Communicator:
    """Tensor-parallel collectives for one rank.

    Args:
        rank: this rank in the group.
        world_size: ranks in the group.
        group: a ``torch.distributed`` ProcessGroup, or None at world size 1.
    """

    def __init__(self, rank: int = 0, world_size: int = 1, group=None):
        if world_size > 1 and group is None:
            raise ValueError(f"world_size={world_size} needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.group = group

    def all_reduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place sum (or "min"/"max") over ranks; returns ``x``."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        ops = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}
        dist.all_reduce(x, op=ops[op], group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``x`` along the last dim on rank 0; other ranks get None."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        dist.gather(x.contiguous(), parts, dst=self._global(0), group=self.group)
        return torch.cat(parts, dim=-1) if self.rank == 0 else None

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dim on all ranks."""
        if self.world_size == 1:
            return x
        import torch.distributed as dist

        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)

    def _global(self, group_rank: int) -> int:
        import torch.distributed as dist

        return dist.get_global_rank(self.group, group_rank)
