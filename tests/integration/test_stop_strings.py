"""``generate(stop_strings=..., tokenizer=...)`` and a passed ``StopStringCriteria`` run natively
in the engine (``SamplingParams.stop``) and give exactly stock's sequences: left-padded batches,
stop strings of one and several tokens, one that reaches back into the prompt, several per call.
Calls the engine can't match exactly (a window that could see pads, a min length) go external
and still equal stock."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.stopping_criteria import StoppingCriteriaList, StopStringCriteria

from hf_paged.integration import paged_call
from hf_paged.testing import left_pad, make_prompts, stock_and_paged, tiny_tokenizer

NEW = 10
LENGTHS = [8, 11, 9, 12]  # left padded to 12


@pytest.fixture
def native_only(monkeypatch):
    def refuse(*a, **kw):
        raise AssertionError("took the external-sampling path")

    monkeypatch.setattr(paged_call, "run_external", refuse)


@pytest.fixture(scope="module")
def case():
    ids, mask = left_pad(make_prompts(LENGTHS, seed=5))
    return ids, mask, tiny_tokenizer()


def stock_new(model, ids, mask):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                             max_new_tokens=NEW)  # fmt: skip
    return out[:, ids.shape[1] :]


def short_run(tok, row, n: int, start: int = 1) -> str:
    """The text of the first ``n`` tokens from ``start`` on in ``row`` (or in any row of a
    2-D tensor) that are one character each (ids past the char set decode to ``<xNN>``, which makes windows long)."""
    rows = row if row.dim() == 2 else row[None]
    for r in rows:
        for j in range(start, len(r) - n + 1):
            texts = [tok.decode(r[k : k + 1]) for k in range(j, j + n)]
            if all(len(t) == 1 for t in texts):
                return "".join(texts)
    raise AssertionError(f"no run of {n} one-character tokens in {rows.tolist()}")


def test_stop_strings_native_equal_stock(model, case, native_only):
    ids, mask, tok = case
    new = stock_new(model, ids, mask)
    w = ids.shape[1]
    both = torch.cat([ids, new], dim=1)
    stops = [
        [short_run(tok, new[0], 2)],  # two tokens of row 0
        [short_run(tok, new[1], 1), short_run(tok, new[2:], 2)],  # several strings
        [short_run(tok, both[3], 2, start=w - 1)],  # from the prompt into the first new token
    ]
    for stop in stops:
        stock, paged, *_ = stock_and_paged(
            model, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
            stop_strings=stop, tokenizer=tok,
        )  # fmt: skip
        assert torch.equal(paged, stock), stop
        assert stock.shape[1] < w + NEW or (stock[:, w:] == 0).any(), stop  # the stop fired


def test_passed_stop_string_criterion_native(model, case, native_only):
    ids, mask, tok = case
    new = stock_new(model, ids, mask)
    stop = short_run(tok, new, 2)

    def fresh():
        return {"stopping_criteria": StoppingCriteriaList([StopStringCriteria(tok, [stop])])}

    stock, paged, *_ = stock_and_paged(model, fresh, input_ids=ids, attention_mask=mask,
                                       do_sample=False, max_new_tokens=NEW)  # fmt: skip
    assert torch.equal(paged, stock)


@pytest.mark.parametrize("extra", [dict(min_new_tokens=3), dict(long_stop=True)], ids=str)
def test_stop_strings_external_equal_stock(model, case, extra):
    ids, mask, tok = case
    new = stock_new(model, ids, mask)
    stop = short_run(tok, new[0], 2)
    if extra.pop("long_stop", False):  # longer than row 0 + 1: stock's window sees its pads
        stop = tok.decode(new[1, 0:4])
        assert len(stop) > LENGTHS[0] + 1
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
        stop_strings=[stop], tokenizer=tok, **extra,
    )  # fmt: skip
    assert torch.equal(paged, stock)
