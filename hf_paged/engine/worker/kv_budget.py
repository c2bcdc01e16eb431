"""The KV cache's budget: an engine's share of a GPU, plain numbers in, a block count or a
clear error out.

An engine sized from ``gpu_memory_utilization`` asks for its share of the device and checks that
the share is free beside what everyone else holds (vLLM's per-instance rule, so two engines at
0.45 fit on one GPU and a third is refused). All figures are bytes:

    share      = total * gpu_memory_utilization          everything this engine may hold;
                 unset: total * 0.9 - others  (0.1 of the device stays free for everyone's
                 transient allocations: a resident HF model's forward, a beam driver's logits)
    in use     = total - driver free - cached free        memory the caching allocator holds but
                                                          no tensor uses is free: any allocation
                                                          of this process can reuse it (a live
                                                          CUDA graph's private pool cannot, so it
                                                          stays in use)
    own        = what this engine allocated so far (weights, buffers) + what its start added
                 outside torch (CUDA libraries' workspaces)
    others     = in use - own                             other engines of this process, its
                                                          other tensors, CUDA contexts, other
                                                          processes
    refused    when share > total - others
    KV bytes   = share - own - activation peak of the profile run
    refused    when KV bytes hold fewer blocks than one max_model_len sequence needs

The arithmetic (:func:`plan_kv_cache`) takes plain numbers and no torch; the device side (a
``CudaMemoryProbe`` reading the device, the ``RunnerMemory`` every ``ModelRunner`` keeps) is
``runner_memory.py``. :data:`LIVE_ENGINES` holds every live runner's footprint, so that another
engine's refusal can say who holds the memory.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

GiB = 1024**3
MiB = 1024**2
AUTO_UTILIZATION = 0.9  # the most an engine takes when gpu_memory_utilization is unset


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory, in bytes."""

    total: int  # the device's memory
    free: int  # what the driver reports free (cudaMemGetInfo): the caching allocator's
    # reserved memory counts as used there
    reserved: int  # this process's caching allocator: held from the driver
    allocated: int  # ... of which live tensors use
    graph_pools: int = 0  # ... of which live CUDA graphs' private pools hold unused

    @property
    def cached_free(self) -> int:
        """Held by this process's allocator, used by no tensor, reusable by any allocation."""
        return max(0, self.reserved - self.allocated - self.graph_pools)

    @property
    def in_use(self) -> int:
        """Really held on the device, by anyone (the allocator's free cache counted as free)."""
        return max(0, self.total - self.free - self.cached_free)

    @property
    def outside_torch(self) -> int:
        """Used on the device but not through this process's caching allocator: CUDA contexts,
        libraries' workspaces, NCCL, other processes."""
        return max(0, self.total - self.free - self.reserved)


@dataclass(frozen=True)
class EngineFootprint:
    """What one live engine of this process holds on its device, in bytes."""

    name: str  # e.g. "Qwen3ForCausalLM (max_model_len=40960)"
    device: str
    weights: int  # allocated by its start: weights, fused copies, buffers
    kv_cache: int
    cuda_graphs: int = 0  # static buffers and the graphs' pool
    graph_pool_unused: int = 0  # of which the pool holds without a live tensor

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.cuda_graphs

    def describe(self) -> str:
        parts = f"weights {gib(self.weights)}, KV cache {gib(self.kv_cache)}"
        if self.cuda_graphs:
            parts += f", CUDA graphs {gib(self.cuda_graphs)}"
        return f"{self.name}: {gib(self.total)} ({parts})"


class LiveEngines:
    """The engines of this process that hold device memory now (keyed by their runner)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._by_key: dict[int, EngineFootprint] = {}

    def add(self, key: int, footprint: EngineFootprint) -> None:
        with self._lock:
            self._by_key[key] = footprint

    def remove(self, key: int) -> None:
        with self._lock:
            self._by_key.pop(key, None)

    def on(self, device: str) -> list[EngineFootprint]:
        """The live engines on ``device``, oldest first."""
        with self._lock:
            return [f for f in self._by_key.values() if f.device == device]


LIVE_ENGINES = LiveEngines()


@dataclass(frozen=True)
class KVCachePlan:
    """How an engine's share was divided (bytes), and the block count that came out."""

    num_blocks: int
    kv_bytes: int  # num_blocks * block_bytes
    share: int  # total * gpu_memory_utilization
    available: int  # total - others: the most this engine could hold
    own: int  # this engine's weights and buffers, and what its start added outside torch
    activation_peak: int

    def describe(self) -> str:
        return (
            f"{self.num_blocks} KV blocks ({gib(self.kv_bytes)}) of a share of "
            f"{gib(self.share)} ({gib(self.available)} free for this engine); weights and "
            f"buffers {gib(self.own)}, activations {gib(self.activation_peak)}"
        )


class KVCacheMemoryError(ValueError):
    """The engine's share of the GPU is not free, or cannot hold one max_model_len sequence."""


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


def check_kv_blocks(
    num_blocks: int, own: int, block_bytes: int, block_size: int, max_model_len: int
) -> None:
    """Raise for a KV cache of ``num_blocks`` (the MIN over ranks; ``own``: this rank's) that
    cannot hold one ``max_model_len`` sequence. Raised here, never held in a caller's local:
    an error a runner's frame refers to would keep that runner (and its sockets) alive.

    Raises:
        ValueError: too few blocks, with what to raise or lower.
    """
    need = -(-max_model_len // block_size)
    if num_blocks >= need:
        return
    where = (
        f"another rank of this engine holds only {num_blocks} KV blocks (its own error says why)"
        if own >= need
        else f"the KV cache holds {num_blocks} blocks"
    )
    raise ValueError(
        f"{where} of {block_size} tokens ({block_bytes} bytes each) but "
        f"max_model_len={max_model_len} needs {need}: raise num_kv_blocks / "
        "kv_cache_bytes / gpu_memory_utilization or lower max_model_len"
    )


def plan_kv_cache(
    memory: DeviceMemory,
    *,
    gpu_memory_utilization: float | None,
    engine_bytes: int,
    activation_peak: int,
    block_bytes: int,
    block_size: int,
    max_model_len: int,
    non_torch_bytes: int = 0,
    other_engines: tuple[EngineFootprint, ...] | list[EngineFootprint] = (),
    device: str = "cuda",
) -> KVCachePlan:
    """The KV block count of an engine given its share of ``memory`` (see the module docstring).

    Args:
        memory: the device read after the engine's weights are loaded and its profile run's
            temporaries freed.
        gpu_memory_utilization: the engine's share of ``memory.total``, in (0, 1]; None:
            ``AUTO_UTILIZATION`` of it less what the others hold.
        engine_bytes: what the engine allocated since before its start (weights, buffers).
        activation_peak: the profile run's peak allocation above what was allocated before it.
        block_bytes / block_size: bytes and tokens of one KV block id (all layers, K and V).
        max_model_len: the longest sequence; at least its blocks must fit.
        non_torch_bytes: memory outside torch the engine's start added (>= 0).
        other_engines: this process's other live engines on the device (named in the error).
        device: the device's name, for the error.

    Returns:
        A ``KVCachePlan`` with ``num_blocks >= ceil(max_model_len / block_size)``.

    Raises:
        KVCacheMemoryError: the share is not free beside what is in use, or it leaves too few
            blocks; the message names ``gpu_memory_utilization``, who holds the memory and what
            value would fit. It never reports a negative block count.
    """
    total = memory.total
    own = max(0, engine_bytes) + max(0, non_torch_bytes)
    others = max(0, memory.in_use - own)
    available = max(0, total - others)
    if gpu_memory_utilization is None:
        share = max(0, int(total * AUTO_UTILIZATION) - others)  # 0.1 of the device stays free
        asked = (
            f"gpu_memory_utilization unset ({AUTO_UTILIZATION} of the device less what is in use)"
        )
    else:
        share = int(total * gpu_memory_utilization)
        asked = f"gpu_memory_utilization={gpu_memory_utilization}"
    min_blocks = -(-max_model_len // block_size)
    need = own + max(0, activation_peak) + min_blocks * block_bytes
    fits = _Fit(gpu_memory_utilization, total, need, available, own, activation_peak,
                min_blocks * block_bytes, max_model_len)  # fmt: skip
    if share > available:
        raise KVCacheMemoryError(
            f"{asked} gives this engine {gib(share)} of "
            f"{device}'s {gib(total)}, but only {gib(available)} is free beside what is in "
            f"use: {_in_use_text(memory, engine_bytes, non_torch_bytes, other_engines)}. "
            f"{fits.advice()}"
        )
    kv = share - own - max(0, activation_peak)
    num_blocks = max(0, kv) // block_bytes
    if num_blocks < min_blocks:
        fit_len = num_blocks * block_size
        shorter = f", or max_model_len <= {fit_len}" if fit_len > 0 else ""
        raise KVCacheMemoryError(
            f"{asked} gives this engine {gib(share)} of "
            f"{device}'s {gib(total)}; its weights and buffers take {gib(own)} and the "
            f"activations of its largest step {gib(activation_peak)}, which leaves "
            f"{num_blocks} KV blocks of {block_size} tokens ({block_bytes / MiB:.2f} MiB each), "
            f"but max_model_len={max_model_len} needs {min_blocks}. {fits.advice()}{shorter}"
        )
    return KVCachePlan(num_blocks, num_blocks * block_bytes, share, available, own,
                       max(0, activation_peak))  # fmt: skip


@dataclass(frozen=True)
class _Fit:
    """Which ``gpu_memory_utilization`` values would fit, for the error messages."""

    asked: float | None
    total: int
    need: int  # own + activations + one max_model_len sequence's blocks
    available: int
    own: int
    activation_peak: int
    sequence_bytes: int
    max_model_len: int

    def advice(self) -> str:
        lo = self.need / self.total  # the least share that holds one sequence
        hi = self.available / self.total  # the most that is free
        needs = (
            f"this engine needs at least {_ceil(lo)} (weights and buffers {gib(self.own)}, "
            f"activations {gib(self.activation_peak)}, one max_model_len={self.max_model_len} "
            f"sequence {gib(self.sequence_bytes)})"
        )
        if lo > hi:
            return (
                f"No gpu_memory_utilization fits beside what is in use: {needs} and at most "
                f"{_floor(hi)} is free. Close another engine (LLM.close()) or lower its "
                "gpu_memory_utilization, or lower max_model_len"
            )
        asked = AUTO_UTILIZATION if self.asked is None else self.asked
        value = _floor(hi) if asked > hi else _ceil(lo)
        if not lo <= value <= hi:  # a range narrower than the rounding
            value = round(hi, 4)
        return f"gpu_memory_utilization={value} would fit ({needs}; at most {_floor(hi)} is free)"


def _ceil(x: float) -> float:
    return math.ceil(x * 100 - 1e-9) / 100


def _floor(x: float) -> float:
    return math.floor(x * 100 + 1e-9) / 100


def _in_use_text(memory: DeviceMemory, engine_bytes: int, non_torch_bytes: int, engines) -> str:
    """Who holds the device's memory, besides this engine."""
    parts = []
    if engines:
        listed = "; ".join(e.describe() for e in engines)
        n = len(engines)
        parts.append(f"{n} other engine{'s' if n > 1 else ''} of this process ({listed})")
    engines_allocated = sum(e.weights + e.kv_cache for e in engines)
    tensors = max(0, memory.allocated - max(0, engine_bytes) - engines_allocated)
    parts.append(f"{gib(tensors)} of this process's other tensors")
    outside = max(0, memory.outside_torch - max(0, non_torch_bytes))
    parts.append(
        f"{gib(outside)} outside this process's torch allocator (CUDA contexts, libraries, "
        "other processes)"
    )
    return ", ".join(parts)
