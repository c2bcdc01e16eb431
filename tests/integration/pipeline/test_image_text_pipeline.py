"""``pipeline("image-text-to-text", backend="paged")``: stock's outputs, in stock's order, with
every input streamed into one engine run (tiny Gemma 3 and a processor built offline).

Inputs as stock's pipeline takes many of them: a list of chats (each a message with an image
and a question) and a generator of ``{"images", "text"}`` dicts; at ``batch_size=1`` (one
``generate`` call per input for stock) and 4 (padded batches)."""

from __future__ import annotations

import warnings

import pytest
from transformers import pipeline

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing.parity import fallback_warnings
from hf_paged.testing.vlm.frontends import build_gemma3, build_processor, make_images

NEW = 6
ENGINE = dict(kv_block_size=4, max_model_len=128, max_num_seqs=8)


@pytest.fixture(scope="module")
def model():
    m = build_gemma3()
    yield m
    dispatch.release(m)


@pytest.fixture(scope="module")
def pipes(model):
    proc = build_processor(model)
    stock = pipeline("image-text-to-text", model=model, processor=proc)
    paged = pipeline("image-text-to-text", model=model, processor=proc, backend="paged",
                     paged_config=ENGINE)  # fmt: skip
    return stock, paged


def _chats(n):
    return [[{"role": "user", "content": [{"type": "image", "image": im},
                                          {"type": "text", "text": f"what is {i}?" * (i % 3 + 1)}]}]
            for i, im in enumerate(make_images(n, seed=n))]  # fmt: skip


def _pairs(n):
    return [{"images": im, "text": f"q{i} <start_of_image> {'a' * (i % 4)}"}
            for i, im in enumerate(make_images(n, seed=n + 1))]  # fmt: skip


def _run(pipe, inputs, **kw):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = pipe(inputs, max_new_tokens=NEW, **kw)
        out = list(out) if not isinstance(out, list) else out
    assert not fallback_warnings(records), fallback_warnings(records)
    return out


def _counting_steps(model):
    """Counts the engine's steps whose chunks come from more than one input (one engine run)."""
    engine = existing_owner(model).engine
    seen = []
    original = engine.step

    def step():
        res = original()
        seen.append(len(engine.scheduler.running))
        return res

    engine.step = step
    return engine, seen, original


def test_32_chats_at_batch_size_1_stream_into_one_run(model, pipes):
    stock, paged = pipes
    chats = _chats(32)
    want = stock(chats, max_new_tokens=NEW, batch_size=1)
    _run(paged, chats[:1], batch_size=1)  # the engine exists now
    engine, seen, original = _counting_steps(model)
    try:
        got = _run(paged, chats, batch_size=1)
    finally:
        engine.step = original
    assert got == want
    assert max(seen) > 1  # inputs ran side by side: one engine run, not one call per input


@pytest.mark.parametrize("batch_size", [1, 4])
def test_generator_of_pairs(pipes, batch_size):
    stock, paged = pipes
    want = list(stock((p for p in _pairs(9)), max_new_tokens=NEW, batch_size=batch_size))
    assert _run(paged, (p for p in _pairs(9)), batch_size=batch_size) == want


def test_chats_in_padded_batches(pipes):
    stock, paged = pipes
    chats = _chats(7)
    assert _run(paged, chats, batch_size=4) == stock(chats, max_new_tokens=NEW, batch_size=4)


def test_single_input_and_call_options(pipes):
    stock, paged = pipes
    chat = _chats(1)[0]
    assert _run(paged, chat) == stock(chat, max_new_tokens=NEW)
    kw = dict(return_full_text=False, generate_kwargs={"min_new_tokens": NEW})
    assert _run(paged, _chats(3), **kw) == stock(_chats(3), max_new_tokens=NEW, **kw)


def test_backend_hf_stays_stock(model):
    proc = build_processor(model)
    pipe = pipeline("image-text-to-text", model=model, processor=proc, backend="hf")
    assert pipe._forward_params["generate_kwargs"]["backend"] == "hf"
    with pytest.raises(ValueError, match="paged_config=... is not allowed with backend='hf'"):
        pipeline("image-text-to-text", model=model, processor=proc, backend="hf",
                 paged_config=ENGINE)  # fmt: skip
