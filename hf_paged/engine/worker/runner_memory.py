"""A runner's device memory: the probe that reads a CUDA device (``CudaMemoryProbe``, from
``probe_for``) and the ``RunnerMemory`` every ``ModelRunner`` makes before it allocates anything.

With a probe (CUDA) it reads the device then, measures what loading the model allocated, the
profile run's activation peak and what the decode graphs hold, plans the KV cache from the
engine's share (``kv_budget.plan_kv_cache``: the arithmetic), and keeps the runner in
``kv_budget.LIVE_ENGINES`` while it lives. Without a probe (CPU: the KV budget is a byte count)
every step is a no-op. Tests replace ``probe_for`` with a fake that answers the probe's calls
with chosen numbers, so the budget path runs without CUDA.
"""

from __future__ import annotations

import contextlib
import gc
import logging

import torch

from hf_paged.engine.worker.kv_budget import (
    LIVE_ENGINES,
    DeviceMemory,
    EngineFootprint,
    KVCacheMemoryError,
    KVCachePlan,
    plan_kv_cache,
)

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_BYTES = 512 * 1024**2  # the KV cache's cap on CPU without a size given


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


class RunnerMemory:
    """One runner's device memory (see the module docstring).

    Args:
        probe: ``CudaMemoryProbe`` or a stand-in with its calls; None = no-op.
        device: the runner's device, as ``str(torch.device)``.
        name: names the engine in other engines' memory errors.
    """

    def __init__(self, probe, device: str, name: str):
        self.probe = probe
        self.device = device
        self.name = name
        self.weights_bytes = 0  # what loading the model allocated (weights, fused copies)
        self.activation_peak = 0  # the profile run's peak above what was allocated before it
        self.plan: KVCachePlan | None = None  # how the share was divided (sized from memory)
        self.cuda_graph_bytes = 0  # static buffers and the graphs' pool
        self.graph_pool_unused = 0  # of which the pool holds without a live tensor
        self.start = None
        if probe is not None:
            probe.release_cached()  # an engine dropped just before counts as gone
            self.start = probe.read()

    @property
    def active(self) -> bool:
        return self.probe is not None

    def loaded(self) -> None:
        """After the model is loaded and warmed up: what it allocated."""
        if self.probe is not None:
            self.weights_bytes = max(0, self.probe.allocated() - self.start.allocated)

    @contextlib.contextmanager
    def profile_run(self):
        """Around the profile forward: its peak, from the allocator's own statistics."""
        if self.probe is None:
            yield
            return
        self.probe.reset_peak()
        before = self.probe.allocated()
        yield
        self.activation_peak = max(0, self.probe.peak_allocated() - before)

    def own_kv_blocks(self, config, block_bytes: int, block_size: int, max_model_len: int):
        """``(blocks this rank can hold, the KVCacheMemoryError that refused a share or None)``:
        ``num_kv_blocks`` or ``kv_cache_bytes`` as given; else, sized from memory (CUDA), the
        engine's share (``plan_kv_cache``); else (CPU) the engine's whole work (every sequence
        at full length) 8 times over, within ``CPU_DEFAULT_KV_BYTES``. Recurrent layers alone have blocks of
        0 bytes: bookkeeping only."""
        per_seq = -(-max_model_len // block_size)
        if block_bytes == 0:
            return config.num_kv_blocks or config.max_num_seqs * per_seq, None
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks, None
        if config.kv_cache_bytes is not None:
            return config.kv_cache_bytes // block_bytes, None
        if self.active:
            try:
                plan = self.plan_kv_cache(
                    config.gpu_memory_utilization, block_bytes, block_size, max_model_len
                )
            except KVCacheMemoryError as exc:
                return 0, exc
            return plan.num_blocks, None
        # CPU: the engine's whole work 8 times over, so that earlier calls' blocks stay in the
        # prefix cache, within a cap
        return min(CPU_DEFAULT_KV_BYTES // block_bytes, 8 * config.max_num_seqs * per_seq), None

    def plan_kv_cache(self, gpu_memory_utilization: float | None, block_bytes: int, block_size: int,
                      max_model_len: int) -> KVCachePlan:  # fmt: skip
        """The KV plan from the engine's share, read now (the profile run's memory freed).

        Raises:
            KVCacheMemoryError: see ``plan_kv_cache``.
        """
        probe = self.probe
        probe.release_cached(collect=False)
        now = probe.read()
        self.plan = plan_kv_cache(
            now,
            gpu_memory_utilization=gpu_memory_utilization,
            engine_bytes=self.weights_bytes,
            activation_peak=self.activation_peak,
            block_bytes=block_bytes,
            block_size=block_size,
            max_model_len=max_model_len,
            non_torch_bytes=max(0, now.outside_torch - self.start.outside_torch),
            other_engines=LIVE_ENGINES.on(self.device),
            device=self.device,
        )
        logger.info("%s on %s: %s", self.name, self.device, self.plan.describe())
        return self.plan

    @contextlib.contextmanager
    def cuda_graphs(self):
        """Around the graph capture: what the static buffers and the graphs' pool hold."""
        if self.probe is None:
            yield
            return
        reserved, allocated = self.probe.reserved(), self.probe.allocated()
        yield
        self.cuda_graph_bytes = max(0, self.probe.reserved() - reserved)
        grown = max(0, self.probe.allocated() - allocated)
        self.graph_pool_unused = max(0, self.cuda_graph_bytes - grown)

    def register(self, kv_cache_bytes: int) -> None:
        """The runner is up: other engines' errors name it from now on."""
        if self.probe is not None:
            LIVE_ENGINES.add(id(self), self.footprint(kv_cache_bytes))

    def footprint(self, kv_cache_bytes: int) -> EngineFootprint:
        return EngineFootprint(self.name, self.device, self.weights_bytes, kv_cache_bytes,
                               self.cuda_graph_bytes, self.graph_pool_unused)  # fmt: skip

    def release(self) -> None:
        """The runner dropped its tensors: unregister, and hand the allocator's now unused
        blocks back to the driver (after collecting cycles that kept any alive)."""
        LIVE_ENGINES.remove(id(self))
        if self.probe is not None:
            self.probe.release_cached()
