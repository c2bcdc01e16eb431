"""Reading a CUDA device's memory for the KV budget (``memory.py`` does the arithmetic).

The ``ModelRunner`` takes its probe from :func:`probe_for`: a :class:`CudaMemoryProbe` on a CUDA
device, None elsewhere (the CPU KV budget is a byte count). Tests replace ``probe_for`` with a
fake that answers the same five calls with chosen numbers, so the budget path runs without CUDA.
"""

from __future__ import annotations

import gc

import torch

from hf_paged.engine.memory import LIVE_ENGINES, DeviceMemory


class CudaMemoryProbe:
    """The memory queries of one CUDA device (each waits for the device first)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def read(self) -> DeviceMemory:
        """The device now: driver free/total, this process's allocator, and the unused part of
        the live engines' CUDA-graph pools (which no other allocation can reuse)."""
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        pools = sum(f.graph_pool_unused for f in LIVE_ENGINES.on(str(self.device)))
        return DeviceMemory(
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(self.device),
            allocated=torch.cuda.memory_allocated(self.device),
            graph_pools=pools,
        )

    def allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_reserved(self.device)

    def reset_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device)

    def release_cached(self, collect: bool = True) -> None:
        """Hand the allocator's unused blocks back to the driver (other processes see them
        free; a large KV tensor gets one contiguous block); ``collect`` first frees what only
        reference cycles kept alive (a just-dropped engine)."""
        if collect:
            gc.collect()
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()


def probe_for(device: torch.device) -> CudaMemoryProbe | None:
    """The probe that sizes a KV cache on ``device`` from memory, or None (CPU: a byte count)."""
    device = torch.device(device)
    return CudaMemoryProbe(device) if device.type == "cuda" else None
