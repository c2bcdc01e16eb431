"""Hypothesis fuzz of ``generate`` keyword combinations: ``backend="paged"`` against stock.

Seeded, derandomized and bounded. Each example draws a left-padded batch of 1-4 prompts (1-12
tokens) and a greedy combination of length, EOS, pad, processor, output and stop-string keywords
on a tiny fp32 llama (hidden 64, 2 layers) on the real engine. Token ids that drive EOS, bad
words, biases and stop strings are taken from a stock run of the same batch, so they matter.
Paged must return exactly stock's result, or raise the same exception type as stock. A
PagedFallbackWarning is allowed (the result is stock's then), but most examples must go paged.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from hf_paged.integration import dispatch, paged_call
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.integration.route import Beams, Native
from hf_paged.testing import (
    SMALL_ENGINE,
    build_hf_model,
    fallback_warnings,
    left_pad,
    make_prompts,
    tiny_tokenizer,
)

EXAMPLES = 40
MIN_PAGED_SHARE = 0.6
SETTINGS = settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip
REF_NEW = 12  # new tokens of the stock reference run the drawn token ids come from
TALLY = {"examples": 0, "paged": 0, "fallback": 0, "raised": 0, "native": 0, "external": 0}
MIN_PER_PATH = 4  # paged calls on each of the native and external sampling paths


@pytest.fixture(scope="module")
def model():
    """One tiny llama on the real engine for the whole module."""
    dispatch.install()
    dispatch.set_default_backend(None)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    m = build_hf_model("llama", seed=0)
    dispatch.configure(m, **SMALL_ENGINE)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(paged_call, "route", _counting(paged_call.route))
        yield m
    dispatch.release(m)
    torch.set_num_threads(previous)


def _counting(route):
    """``route`` that tallies which sampling path (engine-native or external) each call took."""

    def wrapped(*args, **kwargs):
        way = route(*args, **kwargs)
        if not isinstance(way, Beams):
            TALLY["native" if isinstance(way, Native) else "external"] += 1
        return way

    return wrapped


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _tokens(draw, pool, low=1, high=3):
    return draw(st.lists(st.sampled_from(pool), min_size=low, max_size=high))


def _lengths(draw, width) -> dict:
    kw = {}
    if draw(st.booleans()):
        kw["max_new_tokens"] = draw(st.integers(1, 12))
    else:  # mostly above the prompt width; at or below it (an error) now and then
        kw["max_length"] = width + 12 - draw(st.integers(0, 13))
    if draw(st.booleans()):
        kw["min_new_tokens"] = draw(st.integers(0, 6))
    return kw


def _eos_and_pad(draw, pool) -> dict:
    kw = {}
    form = draw(st.sampled_from(["default", "none", "int", "list"]))
    if form == "none":
        kw["eos_token_id"] = None
    elif form == "int":
        kw["eos_token_id"] = draw(st.sampled_from(pool))
    elif form == "list":
        kw["eos_token_id"] = _tokens(draw, pool)
    if draw(st.booleans()):
        kw["pad_token_id"] = draw(st.sampled_from([0, 9, 255]))
    return kw


def _processors(draw, pool, native_only: bool) -> dict:
    kw = {}
    if native_only or draw(st.booleans()):
        kw["repetition_penalty"] = draw(st.sampled_from([0.8, 1.0, 1.3, 2.0]))
    if native_only:  # only what the engine's own sampler implements
        return kw
    if draw(st.booleans()):
        kw["no_repeat_ngram_size"] = draw(st.integers(1, 3))
    if draw(st.booleans()):
        kw["bad_words_ids"] = [_tokens(draw, pool, 1, 2) for _ in range(draw(st.integers(1, 2)))]
    if draw(st.booleans()):
        kw["sequence_bias"] = [
            [_tokens(draw, pool, 1, 2), draw(st.sampled_from([-20.0, -1.5, 4.0, 30.0]))]
            for _ in range(draw(st.integers(1, 2)))
        ]
    if draw(st.booleans()):
        kw["suppress_tokens"] = _tokens(draw, pool, 1, 4)
    if draw(st.booleans()):
        kw["begin_suppress_tokens"] = _tokens(draw, pool, 1, 4)
    return kw


def _outputs(draw, tokenizer, ref_text, native_only: bool) -> dict:
    kw = {}
    if draw(st.integers(0, 9)) == 7:  # invalid when greedy: both sides must raise alike
        kw["num_return_sequences"] = draw(st.integers(2, 3))
    if draw(st.booleans()):
        kw["return_dict_in_generate"] = True
        kw["output_scores"] = not native_only and draw(st.booleans())
        kw["output_logits"] = not native_only and draw(st.booleans())
    if ref_text and draw(st.booleans()):
        start = draw(st.integers(0, len(ref_text) - 1))
        stop = ref_text[start : start + draw(st.integers(1, 3))]
        kw["stop_strings"] = stop if draw(st.booleans()) else [stop, "\x00zz"]
        kw["tokenizer"] = tokenizer
    return kw


def _call(model, paged: bool, kwargs):
    """``(result or None, exception type or None, fallback messages)`` of one generate call."""
    torch.manual_seed(1234)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        try:
            out = model.generate(**kwargs, **({"backend": "paged"} if paged else {}))
            err = None
        except Exception as exc:  # compared by type with the other side's
            out, err = None, type(exc)
    return out, err, fallback_warnings(records)


def _engine_queries(model) -> int:
    """Prompt tokens the model's engine has looked up in its prefix cache (0 before it exists)."""
    slot = existing_owner(model)
    engine = slot.engine if slot is not None else None
    return 0 if engine is None else engine.stats["prefix_cache_query_tokens"]


def _assert_same(stock, paged, width):
    assert type(paged) is type(stock)
    if isinstance(stock, torch.Tensor):
        assert torch.equal(paged, stock), (paged, stock)
        return
    assert torch.equal(paged.sequences, stock.sequences), (paged.sequences, stock.sequences)
    for name in ("scores", "logits"):
        s, p = getattr(stock, name), getattr(paged, name)
        assert (p is None) == (s is None), name
        if s is not None:
            assert len(p) == len(s) == stock.sequences.shape[1] - width, name
            for a, b in zip(p, s, strict=True):
                assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5), name


@seed(1404)
@SETTINGS
@given(data=st.data())
def test_generate_keywords_paged_equals_stock(model, tokenizer, data):
    draw = data.draw
    lengths = draw(st.lists(st.integers(1, 12), min_size=1, max_size=4), label="lengths")
    ids, mask = left_pad(make_prompts(lengths, seed=draw(st.integers(0, 999), label="seed")))
    width = ids.shape[1]
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=REF_NEW,
                         do_sample=False)  # fmt: skip
    pool = sorted({int(t) for t in ref[:, width:].reshape(-1)})
    ref_text = tokenizer.decode(ref[draw(st.integers(0, len(lengths) - 1)), width:])
    native_only = draw(st.booleans(), label="native_only")
    kwargs = dict(input_ids=ids, attention_mask=mask, do_sample=False)
    kwargs.update(_lengths(draw, width), **_eos_and_pad(draw, pool))
    kwargs.update(_processors(draw, pool, native_only))
    kwargs.update(_outputs(draw, tokenizer, ref_text, native_only))
    note = {k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask")}
    data.draw(st.just(note), label="kwargs")
    stock, stock_err, _ = _call(model, False, kwargs)
    queried = _engine_queries(model)
    paged, paged_err, msgs = _call(model, True, kwargs)
    TALLY["examples"] += 1
    assert paged_err == stock_err, (paged_err, stock_err)
    if stock_err is not None:
        TALLY["raised"] += 1
        return
    TALLY["fallback" if msgs else "paged"] += 1
    if not msgs:  # the engine itself took this call's prompts
        assert _engine_queries(model) >= queried + ids.shape[0]
    _assert_same(stock, paged, width)


def test_most_examples_ran_paged():
    """Runs after the fuzz (file order): the paged path, not the fallback, answered most."""
    if TALLY["examples"] == 0:
        pytest.skip("the fuzz test did not run")
    print(f"\ngenerate fuzz tally: {TALLY}")
    assert TALLY["raised"] >= 1, TALLY  # invalid combinations were drawn and compared too
    assert TALLY["paged"] >= MIN_PAGED_SHARE * TALLY["examples"], TALLY
    assert min(TALLY["native"], TALLY["external"]) >= MIN_PER_PATH, TALLY
