"""``LLM.update_weights`` on a tensor-parallel engine (gloo, CPU): every rank copies its part of
the new full tensors (fused q/k/v and gate/up shards, row-parallel halves) in place, so greedy
outputs equal a fresh tp=1 engine on the new weights, with the same engine and KV cache; bad
names and shapes are refused by name."""

from __future__ import annotations

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.testing import build_hf_model, save_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_model_len=64, kv_block_size=8, num_kv_blocks=48)
PROMPTS = [[5], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [40, 41, 42]]


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_update_weights_reaches_every_rank(tmp_path):
    old = save_tiny_model("llama", str(tmp_path / "old"), seed=1)
    new = save_tiny_model("llama", str(tmp_path / "new"), seed=2)
    with LLM(new, **ENGINE) as ref:
        expected = _tokens(ref)
    with LLM(old, tensor_parallel_size=2, **ENGINE) as llm:
        before = _tokens(llm)
        engine, kv = llm.engine, llm.engine.executor.runner.kv_cache
        policy = build_hf_model("llama", seed=2)  # the weights saved in ``new``
        copied = llm.update_weights(policy.named_parameters())
        assert copied == len(dict(policy.named_parameters()))
        assert _tokens(llm) == expected != before
        assert llm.engine is engine and llm.engine.executor.runner.kv_cache is kv
        with pytest.raises(ValueError, match="'model.nope.weight' is not a weight"):
            llm.update_weights([("model.nope.weight", policy.lm_head.weight)])
        with pytest.raises(ValueError, match="lm_head.weight. does not fit"):
            llm.update_weights([("lm_head.weight", policy.lm_head.weight[:3])])
        assert _tokens(llm) == expected  # refused before any rank changed: still served


def test_update_weights_refused_on_an_in_memory_model():
    model = build_hf_model("llama", seed=1)
    with LLM(model, **ENGINE) as llm:
        with pytest.raises(ValueError, match="update_weights is not allowed on an LLM built on"):
            llm.update_weights(model.named_parameters())
