"""Tensor parallelism over NCCL with the whole GPU fast path on every rank (Triton attention,
PDL where the device has it, decode CUDA graphs with the all-reduce captured inside): greedy
tokens equal tp=1 in fp32, graphs equal eager, and every rank takes its share of its device."""

from __future__ import annotations

import gc

import pytest
import torch

from hf_paged import LLM, SamplingParams
from tests.tp.nccl_models import ENGINE, needs_gpus, prompts, save_model

pytestmark = pytest.mark.multi_gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

SP = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def tokens(llm, ps) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(ps, SP, use_tqdm=False)]


@pytest.mark.parametrize(
    "family, kv_heads, tp",
    [
        ("llama", 4, 2),  # KV heads sharded, 2 per rank
        ("qwen3", 1, 2),  # one KV head, replicated on both ranks
        pytest.param("llama", 2, 4, marks=needs_gpus(4)),  # 2 KV heads, each on 2 of 4 ranks
    ],
)
def test_nccl_tp_matches_tp1(tmp_path, family, kv_heads, tp):
    path = save_model(family, str(tmp_path / family), num_key_value_heads=kv_heads)
    ps = prompts()
    with LLM(path, **ENGINE) as llm:
        ref = tokens(llm, ps)
    with LLM(path, tensor_parallel_size=tp, **ENGINE) as llm:
        runner = llm.engine.executor.runner  # rank 0's; the workers run the same spec
        assert runner.comm.world_size == tp
        assert runner.attn_backend.name == "triton"
        assert runner.cuda_graph_reason is None and runner.graph_runner is not None
        assert runner.kv_specs[0].num_kv_heads == max(1, kv_heads // tp)
        got = tokens(llm, ps)
        stats = llm.stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert got == ref


def test_nccl_tp2_cuda_graph_decode_equals_eager(tmp_path, monkeypatch):
    path = save_model("llama", str(tmp_path / "llama"), num_key_value_heads=4)
    ps = prompts(20, seed=1)  # 21 sequences: the 32 graph replays with padding rows
    cfg = dict(ENGINE, num_kv_blocks=200, max_num_seqs=32, tensor_parallel_size=2)
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


def test_nccl_tp2_each_rank_takes_its_share(tmp_path):
    """Every rank sizes its cache from its share of its own device (``gpu_memory_utilization``
    of the device's memory, vLLM's per-instance rule) and all take the minimum: memory someone
    else holds on cuda:1 leaves the block count alone while the share is still free there, and
    a start is refused, naming the setting and cuda:1, once it is not."""
    from hf_paged.engine.worker.tp.workers import EngineDeadError

    path = save_model("llama", str(tmp_path / "llama"), num_key_value_heads=4)
    cfg = dict(ENGINE, num_kv_blocks=None, gpu_memory_utilization=0.3, tensor_parallel_size=2)
    torch.empty(1, device="cuda:1")  # this process's context on cuda:1 exists in both runs
    with LLM(path, **cfg) as llm:
        blocks = llm.stats["num_kv_blocks"]
        ref = tokens(llm, prompts(3))
    hog = torch.empty(8 << 30, dtype=torch.uint8, device="cuda:1")
    try:
        with LLM(path, **cfg) as llm:
            assert llm.stats["num_kv_blocks"] == blocks  # 8 GiB held, the share still free
            assert tokens(llm, prompts(3)) == ref
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
