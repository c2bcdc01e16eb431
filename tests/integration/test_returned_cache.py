"""The cache a paged ``generate`` call returns and takes, against stock's in fp32, for the four
families of ``family_model`` (conftest.py): native Llama, a generic-path model with sliding
layers (Gemma 2), an MoE (Qwen3-MoE) and a hybrid with Gated DeltaNet layers (Qwen3.5: its
cache holds their conv and recurrent states). Contents compare at attended positions
(``testing/caches.py``)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache
from transformers.generation import CompileConfig

from hf_paged.models.recurrent.registry import recurrent_modules
from hf_paged.testing import left_pad, make_prompts
from hf_paged.testing.caches import assert_same_cache, grown_mask

NEW = 5


def _batch(model, lengths=(1, 6)):
    vocab = model.config.vocab_size
    return left_pad([[t % vocab for t in p] for p in make_prompts(list(lengths), seed=3)])


def _both(model, **kw):
    kw = {"max_new_tokens": NEW, "do_sample": False, "return_dict_in_generate": True, **kw}
    return model.generate(**kw), model.generate(**kw, backend="paged")


def test_returned_cache_equals_stock(family_model, refusals):
    model = family_model
    ids, mask = _batch(model)
    stock, paged = _both(model, input_ids=ids, attention_mask=mask)
    assert refusals == []
    assert torch.equal(paged.sequences, stock.sequences)
    length = stock.sequences.shape[1] - 1
    assert_same_cache(stock.cache, paged.cache, grown_mask(mask, length, ids.shape[0]))


def test_static_cache_returns_a_static_cache(family_model, refusals):
    model = family_model
    ids, mask = _batch(model)
    stock, paged = _both(model, input_ids=ids, attention_mask=mask, cache_implementation="static")
    assert refusals == []
    assert isinstance(paged.cache, StaticCache)
    assert torch.equal(paged.sequences, stock.sequences)
    length = stock.sequences.shape[1] - 1
    assert_same_cache(stock.cache, paged.cache, grown_mask(mask, length, ids.shape[0]))


def test_continuing_from_the_returned_cache(family_model, refusals):
    model = family_model
    """The documented "continue from past key values" pattern: the second call takes the first
    call's sequences plus new tokens and its cache."""
    ids, mask = _batch(model)
    stock, paged = _both(model, input_ids=ids, attention_mask=mask)
    more = torch.tensor([[5, 9, 4], [7, 3, 8]]) % model.config.vocab_size
    grown = torch.cat([grown_mask(mask, stock.sequences.shape[1], 2).long(), torch.ones(2, 3)], 1)
    kw = dict(attention_mask=grown.long(), max_new_tokens=NEW, do_sample=False,
              return_dict_in_generate=True, output_scores=True)  # fmt: skip
    s2 = model.generate(torch.cat([stock.sequences, more], 1), cache=stock.cache, **kw)
    p2 = model.generate(torch.cat([paged.sequences, more], 1), cache=paged.cache, **kw,
                        backend="paged")  # fmt: skip
    assert refusals == []
    assert torch.equal(p2.sequences, s2.sequences)
    for x, y in zip(s2.scores, p2.scores, strict=True):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    assert_same_cache(s2.cache, p2.cache, grown_mask(grown, s2.sequences.shape[1] - 1, 2))


def test_multi_turn_chat_feeding_the_cache_back(family_model, refusals):
    model = family_model
    """Three turns, one cache per side fed back every turn (filled in place, as stock fills it):
    served paged and equal to stock at every turn."""
    vocab = model.config.vocab_size
    # stock's hybrid layers need the config to know which layers are recurrent
    config = {"config": model.config} if recurrent_modules(model) else {}
    caches = {"stock": DynamicCache(**config), "paged": DynamicCache(**config)}
    seqs = dict.fromkeys(caches, torch.tensor([[t % vocab for t in make_prompts([5], seed=1)[0]]]))
    for turn in range(3):
        outs = {}
        for side, extra in (("stock", {}), ("paged", {"backend": "paged"})):
            outs[side] = model.generate(seqs[side], past_key_values=caches[side], max_new_tokens=4,
                                        return_dict_in_generate=True, output_scores=True, **extra)  # fmt: skip
            assert outs[side].cache is caches[side]
        assert torch.equal(outs["paged"].sequences, outs["stock"].sequences), turn
        for x, y in zip(outs["stock"].scores, outs["paged"].scores, strict=True):
            torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
        length = outs["stock"].sequences.shape[1] - 1
        # the hybrid's recurrent states are summed chunk-wise by the engine, step by step by
        # stock: three turns in, a few of its K / V values differ by 2e-5
        tol = 1e-4 if recurrent_modules(model) else 1e-5
        ones = torch.ones(1, length, dtype=torch.bool)
        assert_same_cache(caches["stock"], caches["paged"], ones, tol=tol)
        user = torch.tensor([[t % vocab for t in make_prompts([3], seed=10 + turn)[0]]])
        seqs = {side: torch.cat([out.sequences, user], 1) for side, out in outs.items()}
    assert refusals == []


@pytest.mark.parametrize("scores", [False, True], ids=["native", "external"])
def test_a_row_that_stops_early_holds_stocks_pad_tokens(family_models, refusals, scores):
    """Stock feeds a finished row pad tokens until the batch ends: its cache holds their KV."""
    model = family_models["llama"]
    ids, mask = _batch(model, (4, 9))
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    eos = int(ref[0, ids.shape[1] + 2])  # row 0 stops after its third token
    stock, paged = _both(model, input_ids=ids, attention_mask=mask, eos_token_id=eos,
                         pad_token_id=0, max_new_tokens=8, output_scores=scores)  # fmt: skip
    assert refusals == []
    assert torch.equal(paged.sequences, stock.sequences)
    assert (stock.sequences[0, -2:] == 0).all()  # row 0 ended: pads to the end
    length = stock.sequences.shape[1] - 1
    assert_same_cache(stock.cache, paged.cache, grown_mask(mask, length, 2))


def test_beams_return_stocks_reordered_cache(family_models, refusals):
    model = family_models["llama"]
    ids, mask = _batch(model, (3, 6))
    stock, paged = _both(model, input_ids=ids, attention_mask=mask, num_beams=3)
    assert refusals == []
    assert torch.equal(paged.sequences, stock.sequences)
    rows, length = 6, int(stock.cache.get_seq_length())  # the running beams, not the returned
    assert_same_cache(stock.cache, paged.cache, grown_mask(mask, length, rows))


def test_a_cache_of_other_tokens_runs_stock(family_models, refusals):
    model = family_models["llama"]
    ids = torch.tensor([make_prompts([7], seed=4)[0]])
    other = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.tensor([make_prompts([4], seed=5)[0]]), cache=other)
    stock = model.generate(ids, cache=_copy(other), max_new_tokens=NEW, do_sample=False)
    paged = model.generate(ids, cache=other, max_new_tokens=NEW, do_sample=False, backend="paged")
    assert refusals == ["past_key_values"]
    assert torch.equal(paged, stock)


def test_a_legacy_tuple_cache_runs_stock(family_models, refusals):
    model = family_models["llama"]
    ids = torch.tensor([make_prompts([7], seed=4)[0]])
    legacy = tuple((torch.zeros(1, 2, 3, 16), torch.zeros(1, 2, 3, 16)) for _ in range(2))
    with pytest.raises(ValueError, match="tuple"):  # stock's own error in this transformers
        model.generate(ids, cache=legacy, max_new_tokens=NEW, backend="paged")
    assert refusals == ["past_key_values"]


def test_compile_config_sets_up_stocks_compiled_forward(family_models, refusals):
    """Where stock's criteria say it would compile its forward, the paged call leaves
    ``_compiled_call`` on the model as stock does (nothing compiles until it is called)."""
    model = family_models["llama"]
    config = CompileConfig()
    config._compile_all_devices = True  # stock compiles on CPU only when told to
    model.__dict__.pop("_compiled_call", None)
    ids, mask = _batch(model)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, backend="paged",
                   cache_implementation="static", compile_config=config)  # fmt: skip
    assert refusals == []
    assert hasattr(model, "_compiled_call") and model._last_compile_config == config
    model.__dict__.pop("_compiled_call")


def _copy(cache: DynamicCache) -> DynamicCache:
    import copy

    return copy.deepcopy(cache)


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_a_vlm_call_returns_stocks_cache(family, refusals):
    """Image rows reach the returned cache too (Qwen2-VL: M-RoPE positions past the prompt)."""
    from hf_paged.integration import dispatch
    from hf_paged.testing.vlm import ENGINE, PAD, batch, build_tiny_vlm, image

    model = build_tiny_vlm(family)
    dispatch.configure(model, **ENGINE)
    try:
        kw = batch(model, [[[5, 6], image(model, 0), [7]], [[9], image(model, 1), [8, 3, 4]]])
        stock, paged = _both(model, **kw, pad_token_id=PAD)
        assert refusals == []
        assert torch.equal(paged.sequences, stock.sequences)
        length = int(stock.cache.get_seq_length())
        assert_same_cache(stock.cache, paged.cache, grown_mask(kw["attention_mask"], length, 2))
    finally:
        dispatch.release(model)


@pytest.mark.parametrize(
    ("family", "reason"), [("lfm2", "recurrent_cache"), ("minimax", "returned_cache")]
)
def test_recurrent_layers_of_other_kinds_run_stock_by_name(family, reason, refusals):
    """LFM2's short convolutions keep their state in a layout of their own; MiniMax builds its
    own cache class in its forward: the calls that return the cache run stock."""
    from hf_paged.integration import dispatch
    from hf_paged.testing import SMALL_ENGINE, build_tiny

    model = build_tiny(family, seed=0)[1]
    dispatch.configure(model, **SMALL_ENGINE)
    try:
        ids, mask = _batch(model)
        stock, paged = _both(model, input_ids=ids, attention_mask=mask)
        assert refusals == [reason]
        assert torch.equal(paged.sequences, stock.sequences)
        assert type(paged.cache) is type(stock.cache)
    finally:
        dispatch.release(model)
