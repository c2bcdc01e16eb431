"""``LLMEngine.request_kv``: the KV of paused external-sampling requests, read back from their
blocks (one gather per layer), equals stock's cache of the same tokens; what it cannot read is a
ValueError naming the request."""

from __future__ import annotations

import pytest
import torch

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.testing import SMALL_ENGINE, build_hf_model, make_prompts


@pytest.fixture(scope="module")
def hf_and_engine():
    hf = build_hf_model("qwen3", seed=0)
    with LLMEngine(hf, SMALL_ENGINE) as engine:  # blocks of 4 tokens: rows cross blocks
        yield hf, engine


def test_request_kv_equals_stocks_cache(hf_and_engine):
    hf, engine = hf_and_engine
    prompts = make_prompts([1, 5, 9], seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    with engine.request_group() as group:
        rids = [group.add(EngineRequest(p, params, external_sampling=True)) for p in prompts]
        group.await_logits([(rid, 0) for rid in rids], 64)
        kv = engine.request_kv(rids)  # per layer: [T, H, D], rows one after another
        for rid in rids:
            group.close(rid)
        group.drain()
    assert len(kv) == hf.config.num_hidden_layers
    at = 0
    for p in prompts:
        with torch.no_grad():
            stock = hf(input_ids=torch.tensor([p]), use_cache=True).past_key_values
        for (k, v), layer in zip(kv, stock.layers, strict=True):
            ours_k, ours_v = k[at : at + len(p)], v[at : at + len(p)]  # [len, H, D]
            torch.testing.assert_close(ours_k, layer.keys[0].transpose(0, 1), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(
                ours_v, layer.values[0].transpose(0, 1), atol=1e-5, rtol=1e-5
            )
        at += len(p)
    assert kv[0][0].shape[0] == at


def test_request_kv_of_an_unknown_request_is_named(hf_and_engine):
    _, engine = hf_and_engine
    with pytest.raises(ValueError, match="request_id='nope'"):
        engine.request_kv(["nope"])


def test_request_states_of_a_model_without_recurrent_layers_is_empty(hf_and_engine):
    _, engine = hf_and_engine
    assert engine.request_states(["any"]) == []  # the hybrid's: test_returned_cache.py
