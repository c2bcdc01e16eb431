"""What one ModelRunner holds on its device, and how its KV cache's share was sized.

The runner makes one ``RunnerMemory`` before it allocates anything. With a memory probe (CUDA;
``memory_probe.probe_for``) it reads the device then, measures what loading the model allocated,
the profile run's activation peak and what the decode graphs hold, plans the KV cache from the
engine's share (``memory.plan_kv_cache``), and keeps the runner in ``LIVE_ENGINES`` while it
lives, so another engine's refusal can name it. Without a probe (CPU) every step is a no-op.
"""

from __future__ import annotations

import contextlib
import logging

from hf_paged.engine.memory import LIVE_ENGINES, EngineFootprint, KVCachePlan, plan_kv_cache

logger = logging.getLogger(__name__)


class RunnerMemory:
    """One runner's device memory (see the module docstring).

    Args:
        probe: ``memory_probe.CudaMemoryProbe`` or a stand-in with its calls; None = no-op.
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

    def plan_kv_cache(self, gpu_memory_utilization: float | None, block_bytes: int, block_size: int,
                      max_model_len: int) -> KVCachePlan:  # fmt: skip
        """The KV plan from the engine's share, read now (the profile run's memory freed).

        Raises:
            KVCacheMemoryError: see ``memory.plan_kv_cache``.
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
