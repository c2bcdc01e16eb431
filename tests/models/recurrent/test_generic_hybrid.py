"""Hybrid models on the generic path, one step at a time by hand (no engine): the HF recurrent
layers run as their mixers on a state pool beside the paged KV cache, and every step's logits
equal the HF model's on each sequence's whole token list (fp32, CPU)."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_paged.attention import get_backend
from hf_paged.engine.core.request import EngineRequest
from hf_paged.layers.context import ModelContext
from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.models.recurrent.state_pool import StatePool
from hf_paged.models.registry import build_model
from hf_paged.testing import build_metadata, build_tiny, make_kv_cache

FAMILIES = ("qwen3_5_text", "qwen3_next", "olmo_hybrid", "minimax")
BS, MAX_BLOCKS = 4, 24


def _engine_model(model_type: str):
    config, hf = build_tiny(model_type)
    ctx = ModelContext(get_backend("torch"), kv_block_size=BS, max_model_len=BS * MAX_BLOCKS)
    model = build_model(config, ctx, torch.float32, "cpu", "generic")
    model.load_weights(hf)
    return hf, model


@pytest.mark.parametrize("model_type", FAMILIES)
def test_steps_equal_hf_forward(model_type):
    hf, model = _engine_model(model_type)
    n_linear = sum(t == "linear_attention" for t in hf.config.layer_types)
    assert len(model.state_specs) == n_linear
    assert len(model.kv_cache_specs) == len(hf.config.layer_types) - n_linear
    kv = make_kv_cache(model, num_blocks=4 * MAX_BLOCKS, block_size=BS)
    pool = StatePool(model.state_specs, num_slots=4, device="cpu")
    # sequence 0: 30-token prompt in two chunks; 1: 7 tokens; 2: 70 tokens beside decodes;
    # 3: a one-token prompt; a decode continues a sequence by one (random) token
    steps = [
        [(0, 16), (1, 7)],
        [(0, 14), (1, 1), (2, 33)],
        [(2, 37), (3, 1), (0, 1)],
        [(0, 1), (1, 1), (3, 1)],
    ]  # fmt: skip  (the last step is decode-only)
    g = torch.Generator().manual_seed(0)
    total = {s: sum(n for step in steps for t, n in step if t == s) for s in range(4)}
    toks = {s: torch.randint(3, 192, (n,), generator=g).tolist() for s, n in total.items()}
    slots = {s: pool.alloc() for s in toks}
    done = {s: 0 for s in toks}
    for step in steps:
        seqs = [s for s, _ in step]
        q_lens = [n for _, n in step]
        ctx_lens = [done[s] + n for s, n in step]
        meta, positions = build_metadata(q_lens, ctx_lens, BS, MAX_BLOCKS, kv_cache=kv)
        # build_metadata gives sequence i blocks of row i: use the sequence id as its row
        meta.block_tables = torch.tensor([[s * MAX_BLOCKS + b for b in range(MAX_BLOCKS)]
                                          for s in seqs], dtype=torch.int32)  # fmt: skip
        meta.slot_mapping = torch.tensor([s * MAX_BLOCKS * BS + p for s, n in step
                                          for p in range(done[s], done[s] + n)])  # fmt: skip
        meta.state_indices = torch.tensor([slots[s] for s in seqs])
        meta.has_initial_state = torch.tensor([done[s] > 0 for s in seqs])
        meta.recurrent_states = pool.layers
        ids = torch.tensor([t for s, n in step for t in toks[s][done[s] : done[s] + n]])
        with torch.inference_mode():
            logits = model.compute_logits(model(ids, positions, meta))
        at = 0
        for s, n in step:
            with torch.no_grad():
                ref = hf(torch.tensor([toks[s][: done[s] + n]])).logits[0, done[s] :]
            torch.testing.assert_close(logits[at : at + n], ref, atol=5e-4, rtol=1e-3)
            done[s] += n
            at += n


def test_unserved_recurrent_family_is_refused_by_name(monkeypatch):
    from hf_paged.models.generic.support import static_refusal
    from hf_paged.models.recurrent import registry

    monkeypatch.setitem(registry.MIXERS, "Qwen3_5GatedDeltaNet", None)  # as if no mixer
    config, hf = build_tiny("qwen3_5_text")
    assert "hybrid/recurrent" in static_refusal(config).detail
    assert "Qwen3_5GatedDeltaNet" in static_refusal(config).detail
    ctx = ModelContext(get_backend("torch"), kv_block_size=BS, max_model_len=64)
    with pytest.raises(UnsupportedModelError, match="Qwen3_5GatedDeltaNet"):
        build_model(config, ctx, torch.float32, "cpu", "generic")


def test_tensor_parallel_is_refused_by_name():
    from hf_paged.models.generic.recurrent import recurrent_refusal

    _, hf = build_tiny("qwen3_5_text")
    assert recurrent_refusal(hf, 1) is None
    assert "tensor_parallel_size=2" in recurrent_refusal(hf, 2).detail


def test_beam_search_falls_back_by_name():
    from hf_paged import release
    from hf_paged.testing import left_pad, stock_and_paged

    _, hf = build_tiny("qwen3_5_text")
    ids, mask = left_pad([[5, 6, 7, 8], [9, 10]])
    stock, paged, _, _, msgs = stock_and_paged(
        hf, expect_fallback=True, input_ids=ids, attention_mask=mask, max_new_tokens=4,
        do_sample=False, pad_token_id=0, num_beams=2,
    )  # fmt: skip
    release(hf)
    assert any("[recurrent_beams]" in m for m in msgs), msgs
    assert torch.equal(stock, paged)


def test_assisted_decoding_as_stock():
    """Assisted generation on a stateful model: where stock refuses it (transformers < 5.25),
    the paged call raises the same; where stock runs it, the paged call runs stock, named (a
    recurrent state cannot take back rejected tokens)."""
    from hf_paged import release
    from hf_paged.testing import fallback_warnings, left_pad

    _, hf = build_tiny("qwen3_5_text")
    ids, mask = left_pad([[5, 6, 7, 8]])
    kw = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
              prompt_lookup_num_tokens=2)  # fmt: skip
    try:
        stock = hf.generate(ids, **kw)
    except ValueError as e:
        assert "stateful" in str(e)
        with pytest.raises(ValueError) as paged:
            hf.generate(ids, backend="paged", **kw)
        assert str(paged.value) == str(e)
    else:
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            paged = hf.generate(ids, backend="paged", **kw)
        msgs = fallback_warnings(records)
        assert len(msgs) == 1 and "[recurrent_assisted]" in msgs[0], msgs
        assert torch.equal(paged, stock)
    finally:
        release(hf)


def test_speculative_proposer_is_refused_by_name(tmp_path):
    from hf_paged import LLM
    from hf_paged.engine.spec.proposers import NgramProposer

    _, hf = build_tiny("qwen3_5_text")
    with LLM(hf, kv_block_size=4, max_model_len=64, num_kv_blocks=64) as llm:
        assert llm.stats["num_state_slots"] == llm.engine.config.max_num_seqs
        assert llm.stats["state_slot_bytes"] > 0
        assert not llm.engine.runtime.enable_prefix_caching  # derived: off for recurrent layers
        assert llm.engine.config.enable_prefix_caching  # the user's config stays as given
        with pytest.raises(ValueError, match="proposer=NgramProposer is not allowed"):
            llm.engine.add_request(EngineRequest([5, 6, 7], proposer=NgramProposer(2, 2)))
