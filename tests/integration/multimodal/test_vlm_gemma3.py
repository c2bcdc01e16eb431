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

import warnings

import pytest
import torch

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing.parity import fallback_warnings
from hf_paged.testing.vlm import batch, build_tiny_vlm, image, stock_greedy

NEW = 6
ENGINE = dict(kv_block_size=4, num_kv_blocks=256, max_model_len=128)
CRAMPED = dict(ENGINE, max_num_batched_tokens=3, max_num_seqs=2)  # < one image (4 tokens)


def _paged(model, kw, config=ENGINE) -> list[list[int]]:
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = model.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, backend="paged", paged_config=config)  # fmt: skip
    assert not fallback_warnings(records), fallback_warnings(records)
    return out[:, kw["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def gemma3():
    """(model, rows, stock's tokens of each row alone)."""
    model = build_tiny_vlm("gemma3")
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        lm = model.model.language_model
        lm.embed_tokens.weight.mul_(0.02)
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    a, b, c = image(model, 1), image(model, 2), image(model, 3)
    rows = [
        [[5, 6, 7], a, [8, 9]],
        [[10], b, [11, 12, 13, 14, 15, 16]],
        [[20, 21], c, [22]],
        [[30, 31, 32, 33]],
        [[5, 6, 7], b, [8, 9]],
    ]
    yield model, rows, stock_greedy(model, rows, NEW)
    dispatch.release(model)


def test_left_padded_batch(gemma3):
    model, rows, stock = gemma3
    assert _paged(model, batch(model, rows)) == stock


def test_each_alone_on_one_engine(gemma3):
    model, rows, stock = gemma3
    got = [_paged(model, batch(model, [r]))[0] for r in rows]
    engine = existing_owner(model).engine
    assert got == stock
    assert existing_owner(model).engine is engine
    assert stock[0] != stock[4]  # same ids, another image: the image reaches the text


def test_prefill_budget_smaller_than_an_image(gemma3):
    model, rows, stock = gemma3
    assert _paged(model, batch(model, rows), CRAMPED) == stock


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
    assert _paged(model, kw) == causal
