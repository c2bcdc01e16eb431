"""``generate(inputs_embeds=...)`` with and without ``input_ids`` runs paged and returns stock's
tokens, scores, shape and cache, for the four families of ``family_model`` (conftest.py): prefill
from the rows, decode from ids. The rows are random, not any id's embedding, so a path
that embeds the placeholder ids instead of taking the rows gives other tokens."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.registry import recurrent_modules
from hf_paged.testing import left_pad, make_prompts
from hf_paged.testing.caches import assert_same_cache, grown_mask

NEW = 6


def _embeds(model, ids: torch.Tensor) -> torch.Tensor:
    """``[B, L, hidden]`` random rows at the scale of the model's embeddings (no id's)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        rows = model.get_input_embeddings()(ids)
    return rows.std() * torch.randn(rows.shape, generator=g)


def _batch(model, lengths):
    vocab = model.config.vocab_size
    return left_pad([[t % vocab for t in p] for p in make_prompts(list(lengths), seed=3)])


def _both(model, **kw):
    return model.generate(**kw), model.generate(**kw, backend="paged")


@pytest.mark.parametrize("with_ids", [False, True], ids=["embeds_only", "embeds_and_ids"])
def test_inputs_embeds_give_stocks_tokens(family_model, refusals, with_ids):
    model = family_model
    ids, mask = _batch(model, (1, 6))
    extra = {"input_ids": ids} if with_ids else {}
    kw = dict(inputs_embeds=_embeds(model, ids), attention_mask=mask, max_new_tokens=NEW,
              do_sample=False, **extra)  # fmt: skip
    stock, paged = _both(model, **kw)
    assert refusals == []
    width = ids.shape[1] + NEW if with_ids else NEW  # only the new tokens without ids
    assert paged.shape == stock.shape == (2, width)
    assert torch.equal(paged, stock)
    plain = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    assert not torch.equal(stock[:, -NEW:], plain[:, -NEW:])  # the rows, not the ids, decided


def test_inputs_embeds_return_stocks_scores_and_cache(family_model, refusals):
    model = family_model
    ids, mask = _batch(model, (3, 6))
    kw = dict(inputs_embeds=_embeds(model, ids), attention_mask=mask, max_new_tokens=NEW,
              do_sample=False, return_dict_in_generate=True, output_scores=True)  # fmt: skip
    stock, paged = _both(model, **kw)
    assert refusals == []
    assert torch.equal(paged.sequences, stock.sequences)
    for x, y in zip(stock.scores, paged.scores, strict=True):
        torch.testing.assert_close(y, x, atol=1e-4, rtol=1e-4)
    length = int(stock.cache.get_seq_length())  # the embedded prompt + new tokens but the last
    assert length == ids.shape[1] + NEW - 1
    # the hybrid's chunked Gated DeltaNet sums in another order than stock's: on random rows its
    # later layers' K and V differ by a few 1e-5
    tol = 1e-4 if recurrent_modules(model) else 1e-5
    assert_same_cache(stock.cache, paged.cache, grown_mask(mask, length, 2), tol=tol)


def test_inputs_embeds_with_beams_run_stock(family_models, refusals):
    model = family_models["llama"]
    ids, mask = _batch(model, (3, 6))
    kw = dict(inputs_embeds=_embeds(model, ids), attention_mask=mask, max_new_tokens=NEW,
              num_beams=2)  # fmt: skip
    stock, paged = _both(model, **kw)
    assert refusals == ["inputs_embeds"]
    assert torch.equal(paged, stock)
