"""The KV budget arithmetic (``engine/worker/kv_budget.py``), plain numbers in, blocks or an error out.

The figures are the ones measured on an H200 (issue 23): after an engine was closed, its memory
stayed reserved by the caching allocator, ``mem_get_info`` said 14 GB free, and the old budget
(``total * utilization - (total - free) - activations``) came out negative.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hf_paged.engine.worker.kv_budget import (
    DeviceMemory,
    EngineFootprint,
    KVCacheMemoryError,
    plan_kv_cache,
)

GB = 10**9
TOTAL = 140 * GB  # the H200's memory, about
BLOCK = 1835008  # one 16-token block of Qwen3-0.6B in bf16 (28 layers, 8 kv heads, dim 128)
SIZING = dict(block_bytes=BLOCK, block_size=16, max_model_len=40961, device="cuda:0")


def test_memory_the_allocator_holds_free_counts_as_free():
    """The measured case: 125 GB reserved, 1.7 GB allocated, 14 GB free by the driver."""
    mem = DeviceMemory(total=TOTAL, free=14 * GB, reserved=125 * GB, allocated=int(1.7 * GB))
    assert mem.cached_free == int(123.3 * GB)
    assert mem.in_use == int(2.7 * GB)  # 1.7 GB of tensors + 1 GB outside torch
    act = 2 * GB
    old = TOTAL * 0.9 - (TOTAL - mem.free) - act  # the budget before this module
    assert old < 0
    plan = plan_kv_cache(mem, gpu_memory_utilization=0.9, engine_bytes=int(0.5 * GB),
                         activation_peak=act, **SIZING)  # fmt: skip
    assert plan.num_blocks == (int(0.9 * TOTAL) - int(0.5 * GB) - act) // BLOCK
    assert plan.num_blocks > 60_000 > 2561  # ~113 GB of KV, not -51 blocks
    assert plan.kv_bytes == plan.num_blocks * BLOCK


def test_a_live_graph_pool_is_not_free():
    mem = DeviceMemory(total=TOTAL, free=10 * GB, reserved=100 * GB, allocated=60 * GB,
                       graph_pools=3 * GB)  # fmt: skip
    assert mem.cached_free == 37 * GB
    assert mem.in_use == TOTAL - 10 * GB - 37 * GB
    assert mem.outside_torch == 30 * GB


class Device:
    """A simulated GPU: a CUDA context outside torch, this process's engines (weights, KV
    cache and a graph pool each), an in-memory HF model, and cached activation blocks."""

    def __init__(self, context=int(0.5 * GB), hf_model=int(1.2 * GB), cached=GB):
        self.context, self.hf_model, self.cached = context, hf_model, cached
        self.engines: list[EngineFootprint] = []

    def read(self, building: int = 0) -> DeviceMemory:
        """The device while an engine that has allocated ``building`` bytes is being sized."""
        allocated = self.hf_model + building + sum(e.weights + e.kv_cache for e in self.engines)
        pools = sum(e.graph_pool_unused for e in self.engines)
        reserved = allocated + pools + self.cached
        return DeviceMemory(TOTAL, TOTAL - self.context - reserved, reserved, allocated, pools)

    def start(self, utilization: float, weights=int(0.3 * GB), act=2 * GB) -> int:
        """Size one more engine; on success it joins the device (graphs of 0.25 GB)."""
        plan = plan_kv_cache(self.read(weights), gpu_memory_utilization=utilization,
                             engine_bytes=weights, activation_peak=act,
                             other_engines=list(self.engines), **SIZING)  # fmt: skip
        n = len(self.engines) + 1
        graphs = GB // 4
        self.engines.append(EngineFootprint(f"engine {n}: Qwen3ForCausalLM", "cuda:0", weights,
                                            plan.kv_bytes, graphs, graphs))  # fmt: skip
        return plan.num_blocks


def test_two_engines_at_045_fit_and_a_third_is_refused_by_name():
    dev = Device()
    a = dev.start(0.45)
    b = dev.start(0.45)  # a policy and a reference model, or two LLMs
    assert a == b == (int(0.45 * TOTAL) - int(0.3 * GB) - 2 * GB) // BLOCK
    held = sum(e.total for e in dev.engines) + dev.hf_model + dev.context
    assert held <= TOTAL  # both together fit on the device
    with pytest.raises(KVCacheMemoryError) as err:
        dev.start(0.45)
    msg = str(err.value)
    assert "gpu_memory_utilization=0.45" in msg
    assert "2 other engines of this process" in msg
    assert "engine 1: Qwen3ForCausalLM" in msg and "engine 2: Qwen3ForCausalLM" in msg
    assert "this process's other tensors" in msg and "outside this process's torch" in msg
    value = float(re.search(r"gpu_memory_utilization=([0-9.]+) would fit", msg).group(1))
    assert 0 < value < 0.45
    assert dev.start(value) >= 2561  # the value it names does fit
    assert not re.search(r"-\d+ (KV )?blocks", msg)


def test_a_share_too_small_for_one_sequence_names_what_would_fit():
    dev = Device()
    with pytest.raises(KVCacheMemoryError) as err:
        dev.start(0.03)  # 4.2 GB: weights 0.3 + activations 2 leave ~1 k blocks of 2,561
    msg = str(err.value)
    assert "max_model_len=40961 needs 2561" in msg
    assert "max_model_len <= " in msg
    value = float(re.search(r"gpu_memory_utilization=([0-9.]+) would fit", msg).group(1))
    assert value > 0.03 and dev.start(value) >= 2561


def test_nothing_fits_says_so_without_a_negative_count():
    dev = Device(hf_model=135 * GB)  # another model holds nearly all of it
    with pytest.raises(KVCacheMemoryError) as err:
        dev.start(0.5)
    msg = str(err.value)
    assert "No gpu_memory_utilization fits" in msg and "Close another engine" in msg
    with pytest.raises(KVCacheMemoryError) as err:
        dev.start(0.01, weights=3 * GB)  # the share is below the weights alone
    assert "leaves 0 KV blocks" in str(err.value)


@settings(max_examples=300, deadline=None)
@given(
    total=st.integers(GB, 200 * GB),
    used=st.floats(0, 1),
    cached=st.floats(0, 1),
    util=st.floats(0.01, 1.0),
    weights=st.integers(0, 20 * GB),
    act=st.integers(0, 20 * GB),
)
def test_either_enough_blocks_or_a_named_refusal(total, used, cached, util, weights, act):
    reserved = int(total * used)
    allocated = min(reserved, int(reserved * (1 - cached)) + weights)
    mem = DeviceMemory(total, total - reserved, reserved, allocated)
    try:
        plan = plan_kv_cache(mem, gpu_memory_utilization=util, engine_bytes=weights,
                             activation_peak=act, **SIZING)  # fmt: skip
    except KVCacheMemoryError as exc:
        msg = str(exc)
        assert f"gpu_memory_utilization={util}" in msg
        assert not re.search(r"-\d+ (KV )?blocks", msg)
        return
    assert plan.num_blocks >= 2561
    assert plan.kv_bytes + plan.own + plan.activation_peak <= plan.share <= plan.available


def test_unset_utilization_takes_what_is_free_beside_a_resident_model():
    """The drop-in path: an 8B HF model (16 GB) on the GPU, then its engine with
    ``gpu_memory_utilization`` unset. A set 0.9 is refused (126 GB asked, ~123 free: the
    H200 case of bench_fp8 / bench_beams); unset, the engine takes 0.9 of the device less
    what the others hold (taking all that is free left the HF side's forward no room on the
    H200), and with only a CUDA context beside it 0.9 of it less the context."""
    sizing = dict(block_bytes=BLOCK, block_size=16, max_model_len=2048, device="cuda:0")
    weights, act = 16 * GB, GB
    resident = DeviceMemory(
        total=TOTAL, free=TOTAL - 33 * GB, reserved=32 * GB, allocated=32 * GB
    )  # fmt: skip  (HF model + the engine's copy)
    with pytest.raises(KVCacheMemoryError, match=r"gpu_memory_utilization=0\.9 gives"):
        plan_kv_cache(resident, gpu_memory_utilization=0.9, engine_bytes=weights,
                      activation_peak=act, **sizing)  # fmt: skip
    plan = plan_kv_cache(resident, gpu_memory_utilization=None, engine_bytes=weights,
                         activation_peak=act, **sizing)  # fmt: skip
    others = resident.in_use - weights  # the HF model and the CUDA context
    assert plan.share == int(0.9 * TOTAL) - others  # 0.1 of the device stays free
    assert plan.num_blocks == (plan.share - weights - act) // BLOCK
    alone = DeviceMemory(total=TOTAL, free=TOTAL - 17 * GB, reserved=16 * GB, allocated=16 * GB)
    plan = plan_kv_cache(alone, gpu_memory_utilization=None, engine_bytes=weights,
                         activation_peak=act, **sizing)  # fmt: skip
    assert plan.share == int(0.9 * TOTAL) - GB  # less the CUDA context alone


def test_unset_utilization_refused_names_the_setting():
    """Nothing left for an unset engine: the error says it was unset and what is in use."""
    full = DeviceMemory(total=TOTAL, free=2 * GB, reserved=TOTAL - 3 * GB,
                        allocated=TOTAL - 3 * GB)  # fmt: skip
    with pytest.raises(KVCacheMemoryError) as e:
        plan_kv_cache(full, gpu_memory_utilization=None, engine_bytes=GB, activation_peak=GB,
                      **SIZING)  # fmt: skip
    msg = str(e.value)
    assert "gpu_memory_utilization unset" in msg and "-" not in msg.split("leaves")[-1][:4]
    assert "No gpu_memory_utilization fits" in msg or "would fit" in msg
