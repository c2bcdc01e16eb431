"""Tensor parallelism on the generic path (tp=2 over gloo, CPU): the config's TP plan shards a
dense (Gemma2) and a MoE (Qwen3-MoE) model, and the tokens equal tp=1's; a model the plan cannot
split is refused by name before any worker starts."""

from __future__ import annotations

import random

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.testing import build_tiny

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_model_len=64, kv_block_size=4, num_kv_blocks=20, max_num_seqs=4)


@pytest.mark.parametrize("model_type", ["gemma2", "qwen3_moe"])
def test_tp2_matches_tp1(model_type, tmp_path):
    config, model = build_tiny(model_type)
    model.save_pretrained(tmp_path)
    rng = random.Random(0)
    shared = [rng.randrange(3, 190) for _ in range(9)]
    prompts = [[rng.randrange(3, 190)]] + [
        shared + [rng.randrange(3, 190) for _ in range(rng.randint(1, 12))] for _ in range(6)
    ]
    with LLM(str(tmp_path), **ENGINE) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    with LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE) as llm:
        got = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
        stats = llm.stats
        rank0 = llm.engine.executor.runner.model
    assert got == ref
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    # really sharded: half the query heads and KV heads per rank, half the projection rows
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    assert {(s.num_heads, s.num_kv_heads) for s in rank0.layer_specs} == {(heads // 2, kv // 2)}
    q = rank0.hf_model.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert q.shape[0] == heads * rank0.layer_specs[0].head_dim // 2


def test_kv_heads_fewer_than_ranks_are_replicated():
    """MQA-like: 1 KV head, 2 ranks: both ranks keep the head (the rule the loader applies)."""
    import torch

    from hf_paged.models.generic.tp import ShardRule

    w = torch.arange(2 * 4 * 3).reshape(8, 3).float()  # 2 KV heads of dim 4
    rules = [ShardRule(0, r, 4, kv_heads=2) for r in range(4)]
    parts = [r.apply(w) for r in rules]
    assert torch.equal(parts[0], w[:4]) and torch.equal(parts[1], w[:4])
    assert torch.equal(parts[2], w[4:]) and torch.equal(parts[3], w[4:])
    packed = ShardRule(0, 1, 2, packed=2).apply(w)  # gate/up halves, shard 1 of each
    assert torch.equal(packed, torch.cat([w[2:4], w[6:8]]))


@pytest.mark.parametrize(
    "model_type,overrides,why",
    [
        ("falcon", {}, "FalconForCausalLM has no tensor-parallel plan"),
        ("starcoder2", {"intermediate_size": 37}, r"mlp.c_fc.weight has 37 along dim 0"),
        ("lfm2", {}, r"recurrent layers \(Lfm2ShortConv\) are not sharded"),
    ],
)
def test_a_split_the_plan_cannot_make_is_refused_before_workers_start(
    model_type, overrides, why, tmp_path
):
    """No plan, a planned dim that does not divide, recurrent layers: a ValueError naming the
    argument, the value and why, from the calling process (not a worker that dies at build time)."""
    import multiprocessing as mp

    _, model = build_tiny(model_type, **overrides)
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=rf"tensor_parallel_size=2 is not allowed.*{why}"):
        LLM(str(tmp_path), tensor_parallel_size=2, **ENGINE)
    assert not mp.active_children()
