"""Gemma 3 through ``generate(backend="paged")``: its image tokens attend to each other both ways
(per ``token_type_ids``), served as bidirectional ranges; every result token-identical to stock
greedy on each request alone.

A left-padded batch with different images and text lengths; each request alone, one after
another on one engine; an engine whose prefill budget (3) is smaller than an image (4 tokens),
so each image goes whole into one chunk; and the call without ``token_type_ids`` (stock's mask
is causal then, and so is the engine's). The tiny model's embeddings and norms are scaled so
that images and the mask change the text (Gemma scales embeddings by sqrt(hidden)).
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing.vlm import (
    CRAMPED,
    batch,
    mixed_rows,
    paged_greedy,
    paged_tokens,
    stock_greedy,
)
from hf_paged.testing.vlm.frontends import build_gemma3

NEW = 6


@pytest.fixture(scope="module")
def gemma3():
    """(model, rows, stock's tokens of each row alone)."""
    model = build_gemma3()
    rows = mixed_rows(model, wide=False)
    yield model, rows, stock_greedy(model, rows, NEW)
    dispatch.release(model)


def test_left_padded_batch(gemma3):
    model, rows, stock = gemma3
    assert paged_greedy(model, rows, NEW) == stock


def test_each_alone_on_one_engine(gemma3):
    model, rows, stock = gemma3
    got = [paged_greedy(model, [r], NEW)[0] for r in rows]
    engine = existing_owner(model).engine
    assert got == stock
    assert existing_owner(model).engine is engine
    assert stock[0] != stock[4]  # same ids, another image: the image reaches the text


def test_prefill_budget_smaller_than_an_image(gemma3):
    model, rows, stock = gemma3
    assert paged_greedy(model, rows, NEW, CRAMPED) == stock


def test_without_token_type_ids_the_mask_is_causal(gemma3):
    """Stock builds the bidirectional mask only from ``token_type_ids``; without them both
    sides are causal, and the tokens differ from the bidirectional ones for some row."""
    model, rows, stock = gemma3
    causal = []
    for r in rows:
        kw = batch(model, [r])
        del kw["token_type_ids"]
        with torch.no_grad():
            seq = model.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0)  # fmt: skip
        causal.append(seq[0, kw["input_ids"].shape[1] :].tolist())
    assert causal != stock  # the image's bidirectional attention changes the text
    kw = batch(model, rows)
    del kw["token_type_ids"]
    assert paged_tokens(model, kw, NEW) == causal
