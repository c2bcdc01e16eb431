"""Tensor parallelism: parity with tp=1 and the failure paths of a real engine, on CPU (gloo);
and over NCCL (marker ``multi_gpu``) with the whole GPU fast path on every rank (Triton
attention, PDL where the device has it, decode CUDA graphs with the all-reduce captured inside):
greedy tokens equal tp=1 in fp32, graphs equal eager, and every rank takes its share of its
device.
"""

from __future__ import annotations

import functools
import gc
import os
import signal
import threading
import time

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.worker.tp import executor as tp_executor
from hf_paged.engine.worker.tp.workers import EngineDeadError, WorkerGroup
from hf_paged.testing import save_tiny_model
from hf_paged.testing.markers import marked
from hf_paged.testing.procfs import shm_segments
from tests.engine.worker.tp import nccl_models

# ---- on any device --------------------------------------------------------------------------------


PARAMS = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


ENGINE = dict(max_model_len=96, kv_block_size=8, num_kv_blocks=64)


def prompts(n=12, seed=0):
    import random

    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(17)]
    out = [[rng.randrange(3, 256)]]  # a prompt of length 1
    out += [shared + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))] for _ in range(n)]
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {
        "llama": save_tiny_model("llama", str(root / "llama"), seed=1),
        "qwen3_mqa": save_tiny_model("qwen3", str(root / "qwen3"), seed=2, num_key_value_heads=1),
    }


def child_pids() -> set[int]:
    import multiprocessing as mp

    return {p.pid for p in mp.active_children()}


@pytest.mark.parametrize("name", ["llama", "qwen3_mqa"])
def test_tp2_matches_tp1(models, name):
    ps = prompts()
    # small KV pool: preemption happens; shared prefix: the prefix cache hits
    kwargs = dict(ENGINE, num_kv_blocks=14, max_num_seqs=8)
    with LLM(models[name], **kwargs) as llm:
        ref = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
        ref_stats = llm.stats
    with LLM(models[name], tensor_parallel_size=2, **kwargs) as llm:
        # llama: 2 KV heads, one per rank; qwen3_mqa: its one KV head replicated on both ranks
        assert llm.engine.executor.runner.kv_specs[0].num_kv_heads == 1
        got = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
        stats = llm.stats
    assert ref_stats["num_preemptions"] > 0 and stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0
    assert got == ref


def test_worker_sigkill_raises_engine_dead(models):
    before = shm_segments()
    llm = LLM(models["llama"], tensor_parallel_size=2, **ENGINE)
    pid = llm.engine.executor.group.pids[0]
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    long = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError) as err:
        for _ in range(200):  # keep generating until the kill lands
            llm.generate(prompts(), long, use_tqdm=False)
    assert time.monotonic() - t0 < 5.5
    assert err.value.rank == 1
    llm.close()
    llm.close()  # twice is fine
    assert not child_pids()
    assert shm_segments() <= before


def test_a_config_every_rank_refuses_raises_as_at_tp1(models):
    """A KV cache too small fails every rank alike: the caller gets tp=1's ValueError (not an
    EngineDeadError naming whichever worker failed first), and no worker is left."""
    with pytest.raises(ValueError, match=r"the KV cache holds 1 blocks .* max_model_len=96"):
        LLM(models["llama"], tensor_parallel_size=2, **dict(ENGINE, num_kv_blocks=1))
    assert not child_pids()


def test_worker_exception_carries_traceback(models):
    with LLM(models["llama"], tensor_parallel_size=2, **ENGINE) as llm:
        llm.engine.executor.group.broadcast("no_such_method")
        with pytest.raises(EngineDeadError) as err:
            for _ in range(20):
                llm.generate(prompts(2), PARAMS, use_tqdm=False)
        assert "no_such_method" in str(err.value)
        assert "Traceback" in (err.value.worker_traceback or "")
    assert not child_pids()


def test_step_larger_than_shm_buffer(models, monkeypatch):
    monkeypatch.setattr(
        tp_executor, "WorkerGroup", functools.partial(WorkerGroup, shm_capacity=512)
    )
    ps = prompts()
    with LLM(models["llama"], **ENGINE) as llm:
        ref = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
    with LLM(models["llama"], tensor_parallel_size=2, **ENGINE) as llm:
        got = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
    assert got == ref


def test_two_engines_in_one_process(models):
    ps = prompts(6)
    with LLM(models["llama"], **ENGINE) as llm:
        ref_a = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
    with LLM(models["qwen3_mqa"], **ENGINE) as llm:
        ref_b = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
    a = LLM(models["llama"], tensor_parallel_size=2, **ENGINE)
    b = LLM(models["qwen3_mqa"], tensor_parallel_size=2, **ENGINE)
    try:
        results = {}

        def work(key, llm):
            results[key] = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]

        threads = [threading.Thread(target=work, args=k) for k in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert results == {"a": ref_a, "b": ref_b}
    finally:
        a.close()
        b.close()
    assert not child_pids()


# ---- over NCCL on several GPUs --------------------------------------------------------------------


_MARKS_TP_NCCL = [
    pytest.mark.multi_gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


SP = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def tokens(llm, ps) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, SP, use_tqdm=False)]


@marked(_MARKS_TP_NCCL)
@pytest.mark.parametrize(
    "family, kv_heads, tp",
    [
        ("llama", 4, 2),  # KV heads sharded, 2 per rank
        ("qwen3", 1, 2),  # one KV head, replicated on both ranks
        pytest.param(
            "llama", 2, 4, marks=nccl_models.needs_gpus(4)
        ),  # 2 KV heads, each on 2 of 4 ranks
    ],
)
def test_nccl_tp_matches_tp1(tmp_path, family, kv_heads, tp):
    path = nccl_models.save_model(family, str(tmp_path / family), num_key_value_heads=kv_heads)
    ps = nccl_models.prompts()
    with LLM(path, **nccl_models.ENGINE) as llm:
        ref = tokens(llm, ps)
    with LLM(path, tensor_parallel_size=tp, **nccl_models.ENGINE) as llm:
        runner = llm.engine.executor.runner  # rank 0's; the workers run the same spec
        assert runner.comm.world_size == tp
        assert runner.attn_backend.name == "triton"
        assert runner.cuda_graph_reason is None and runner.graph_runner is not None
        assert runner.kv_specs[0].num_kv_heads == max(1, kv_heads // tp)
        got = tokens(llm, ps)
        stats = llm.stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert got == ref


@marked(_MARKS_TP_NCCL)
def test_nccl_tp2_cuda_graph_decode_equals_eager(tmp_path, monkeypatch):
    path = nccl_models.save_model("llama", str(tmp_path / "llama"), num_key_value_heads=4)
    ps = nccl_models.prompts(20, seed=1)  # 21 sequences: the 32 graph replays with padding rows
    cfg = dict(nccl_models.ENGINE, num_kv_blocks=200, max_num_seqs=32, tensor_parallel_size=2)
    with LLM(path, enforce_eager=True, **cfg) as llm:
        assert llm.engine.executor.runner.graph_runner is None
        ref = tokens(llm, ps)
    with LLM(path, **cfg) as llm:
        graphs = llm.engine.executor.runner.graph_runner
        assert graphs is not None and 32 in graphs.graphs
        replayed = []
        original = graphs.replay

        def counting(input_ids, positions, meta):
            replayed.append(meta.num_seqs)
            return original(input_ids, positions, meta)

        monkeypatch.setattr(graphs, "replay", counting)
        got = tokens(llm, ps)
    # pure decode steps (those not mixed with a prefill chunk) went through the graphs
    assert len(replayed) >= SP.max_tokens // 2 and max(replayed) > 16
    assert got == ref


@marked(_MARKS_TP_NCCL)
def test_nccl_tp2_each_rank_takes_its_share(tmp_path):
    """Every rank sizes its cache from its share of its own device (``gpu_memory_utilization``
    of the device's memory, vLLM's per-instance rule) and all take the minimum: memory someone
    else holds on cuda:1 leaves the block count alone while the share is still free there, and
    a start is refused, naming the setting and cuda:1, once it is not."""
    from hf_paged.engine.worker.tp.workers import EngineDeadError

    path = nccl_models.save_model("llama", str(tmp_path / "llama"), num_key_value_heads=4)
    cfg = dict(
        nccl_models.ENGINE, num_kv_blocks=None, gpu_memory_utilization=0.3, tensor_parallel_size=2
    )
    torch.empty(1, device="cuda:1")  # this process's context on cuda:1 exists in both runs
    with LLM(path, **cfg) as llm:
        blocks = llm.stats["num_kv_blocks"]
        ref = tokens(llm, nccl_models.prompts(3))
    hog = torch.empty(8 << 30, dtype=torch.uint8, device="cuda:1")
    try:
        with LLM(path, **cfg) as llm:
            assert llm.stats["num_kv_blocks"] == blocks  # 8 GiB held, the share still free
            assert tokens(llm, nccl_models.prompts(3)) == ref
        free, total = torch.cuda.mem_get_info(1)
        more = torch.empty(free - int(0.2 * total), dtype=torch.uint8, device="cuda:1")
        with pytest.raises((EngineDeadError, ValueError)) as err:
            LLM(path, **cfg)
        assert "gpu_memory_utilization=0.3" in str(err.value) and "cuda:1" in str(err.value)
        del more
    finally:
        del hog
        gc.collect()
        torch.cuda.empty_cache()
