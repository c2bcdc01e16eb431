"""Prompt embeddings on the engine (``EngineRequest.prompt_embeds``): a prefill fed the rows of
``embed(ids)`` gives the tokens a prefill from the ids gives, on the native, generic and hybrid
paths, whole or in chunks; other rows give what stock ``generate(inputs_embeds=)`` gives; the
prefix cache shares KV only between equal rows at equal places."""

from __future__ import annotations

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.engine.core.prompt_embeds import EmbedRange, PromptEmbeds
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.testing import build_hf_model
from hf_paged.testing.any_model import build_tiny
from hf_paged.testing.prompts import make_prompts

NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
# (name, model builder, engine keys): the native decoder, the generic path, a hybrid decoder
PATHS = {
    "native": (lambda: build_hf_model("qwen3", 0), {"model_impl": "native"}),
    "generic": (lambda: build_hf_model("llama", 0), {"model_impl": "generic"}),
    "hybrid": (lambda: build_tiny("qwen3_5_text", 0)[1], {}),
}


@pytest.fixture(scope="module", params=sorted(PATHS))
def served(request):
    build, keys = PATHS[request.param]
    hf = build().eval()
    return request.param, hf, keys


def _engine(hf, keys, **more):
    cfg = dict(max_model_len=96, kv_block_size=4, num_kv_blocks=96, max_num_seqs=4, **keys)
    cfg.update(more)
    return LLMEngine(hf, cfg)


def _embed(hf, ids):
    with torch.no_grad():
        return hf.get_input_embeddings()(torch.tensor(ids, dtype=torch.long)).float()  # [L, H]


def _stock(hf, rows) -> list[int]:
    """Stock greedy from ``inputs_embeds`` alone (it returns only the new tokens)."""
    with torch.no_grad():
        out = hf.generate(inputs_embeds=rows[None], attention_mask=torch.ones(1, len(rows),
                          dtype=torch.long), max_new_tokens=NEW, min_new_tokens=NEW,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, -NEW:].tolist()


def _run(engine, reqs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.run(reqs)]


@pytest.mark.parametrize("budget", [256, 5])  # whole prompts; chunks of 5 tokens across ranges
def test_embed_of_ids_equals_ids(served, budget):
    name, hf, keys = served
    prompts = make_prompts([10, 30, 17], seed=4, vocab=190)
    with _engine(hf, keys, max_num_batched_tokens=budget, enable_prefix_caching=False) as eng:
        from_ids = _run(eng, [EngineRequest(p, PARAMS) for p in prompts])
        dense = [EngineRequest(p, PARAMS, prompt_embeds=PromptEmbeds.dense(_embed(hf, p)))
                 for p in prompts]  # fmt: skip
        # a range in the middle: rows of ids [3, 9), the rest from the ids
        part = [EngineRequest(p, PARAMS, prompt_embeds=PromptEmbeds(
                    [EmbedRange(3, 6)], _embed(hf, p[3:9]))) for p in prompts]  # fmt: skip
        assert _run(eng, dense) == from_ids
        assert _run(eng, part) == from_ids


def test_other_rows_match_stock_inputs_embeds(served):
    """Rows that are no id's embedding: the tokens stock's ``inputs_embeds`` gives."""
    name, hf, keys = served
    if name == "hybrid":
        pytest.skip("stock's hybrid generate(inputs_embeds=) needs input ids for its cache")
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(n, hf.config.hidden_size, generator=g) for n in (5, 11, 17)]
    with _engine(hf, keys, max_num_batched_tokens=7) as eng:
        got = _run(eng, [EngineRequest([1] * len(r), PARAMS, prompt_embeds=PromptEmbeds.dense(r))
                         for r in rows])  # fmt: skip
    assert got == [_stock(hf, r) for r in rows]


def test_prefix_cache_keys_embeds(served):
    """Equal ids with other rows share no KV; the same rows (same key) at the same place do."""
    name, hf, keys = served
    if name == "hybrid":
        pytest.skip("prefix caching is off for recurrent decoders")
    g = torch.Generator().manual_seed(1)
    ids = make_prompts([24], seed=5, vocab=190)[0]
    a, b = (torch.randn(8, hf.config.hidden_size, generator=g) for _ in range(2))

    def req(rows, key):
        return EngineRequest(ids, PARAMS, prompt_embeds=PromptEmbeds([EmbedRange(4, 8, key)], rows))

    with _engine(hf, keys, enable_prefix_caching=True) as eng:
        first = _run(eng, [req(a, "a")])
        before = eng.block_manager.num_prefix_hit_tokens
        other = _run(eng, [req(b, "b")])
        assert eng.block_manager.num_prefix_hit_tokens == before + 4  # only the block before 4
        again = _run(eng, [req(a, "a")])
        assert eng.block_manager.num_prefix_hit_tokens > before + 4 + 12
    with _engine(hf, keys, enable_prefix_caching=False) as eng:
        assert _run(eng, [req(a, "a")]) == first == again
        assert _run(eng, [req(b, "b")]) == other


def test_bad_prompt_embeds_are_named(served):
    name, hf, keys = served
    ids = [1, 2, 3, 4]
    h = hf.config.hidden_size

    def req(pe):
        return EngineRequest(ids, PARAMS, prompt_embeds=pe)

    with _engine(hf, keys) as eng:
        with pytest.raises(ValueError, match="prompt_embeds.rows"):
            eng.add_request(req(PromptEmbeds.dense(torch.zeros(4, h + 1))))
        with pytest.raises(ValueError, match="prompt_embeds.ranges"):
            eng.add_request(req(PromptEmbeds([EmbedRange(2, 3)], torch.zeros(3, h))))
        with pytest.raises(ValueError, match="prompt_embeds.positions"):
            pos = torch.zeros(3, 4)
            eng.add_request(req(PromptEmbeds([EmbedRange(0, 4)], torch.zeros(4, h), positions=pos)))
        with pytest.raises(TypeError, match="prompt_embeds"):
            eng.add_request(req(torch.zeros(4, h)))
        assert not eng.has_unfinished_requests()
