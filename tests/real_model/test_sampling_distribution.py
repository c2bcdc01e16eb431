"""The engine's sampler draws the next token from stock's distribution: the softmax of the demo
model's logits after HF's own warpers (temperature, then top-k, then top-p, as ``generate``
builds them). A chi-square goodness-of-fit test over 10,000 draws per setting must accept the
right distribution and reject a temperature 10% off and an ignored top-p, so the test can tell.

The draws come from ``hf_paged.layers.sampler.Sampler`` (what the engine's runner calls) on the
next-token logits of a real prompt; that the engine computes the same logits as stock is what
the greedy parity tests show. The logits are cut to the prompt's 4,096 likeliest tokens (the rest
hold a negligible mass), the same vector for both sides, which keeps 10,000 top-p draws (a sort
of the vocabulary per draw) to seconds on 2 cores.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing.chat_prompts import chat_ids

pytestmark = pytest.mark.real_model

DRAWS = 10_000
ALPHA = 1e-3  # a right distribution is rejected once in a thousand runs (seeds are fixed)
SETTINGS = {
    "temperature": dict(temperature=0.7),
    "top_k": dict(temperature=1.0, top_k=20),
    "top_p": dict(temperature=0.9, top_p=0.8),
}


@pytest.fixture(scope="module")
def next_logits(stock_fp32, demo_tokenizer):
    """[4096] fp32 logits of the first answer token of an open question (a spread distribution),
    its likeliest tokens in descending order."""
    ids = chat_ids(demo_tokenizer, ["Write the first line of a story about a lighthouse."])[0]
    with torch.no_grad():
        logits = stock_fp32(torch.tensor([ids])).logits[0, -1].float()
    return logits.topk(4096).values


def stock_probs(logits, temperature=1.0, top_k=0, top_p=1.0) -> torch.Tensor:  # [V]
    """What stock ``generate(do_sample=True, ...)`` samples from, with HF's own warpers."""
    from transformers import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,  # fmt: skip
    )

    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    return warpers(None, logits[None].clone())[0].softmax(-1)


def engine_draws(logits, **params) -> torch.Tensor:  # [V] counts
    from hf_paged import SamplingParams
    from hf_paged.layers.sampler import Sampler, SamplingMetadata

    sampler = Sampler(torch.Generator().manual_seed(1234))
    counts = torch.zeros(logits.shape[-1])
    rows = 1000
    meta = SamplingMetadata.build([SamplingParams(max_tokens=1, **params)] * rows)
    for _ in range(DRAWS // rows):
        tokens = sampler(logits[None].expand(rows, -1), meta).token_ids
        counts += torch.bincount(tokens, minlength=logits.shape[-1]).float()
    return counts


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness-of-fit p-value; tokens expected fewer than 5 times share one bin, and a draw of
    a token the distribution excludes gives p = 0."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = probs.double() * n
    if bool(((expected == 0) & (counts > 0)).any()):
        return 0.0
    big = expected >= 5
    obs = torch.cat([counts[big].double(), counts[~big].sum()[None].double()])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(chisquare(obs.numpy(), exp.numpy() * obs.sum().item() / exp.sum().item()).pvalue)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_engine_samples_from_stocks_distribution(next_logits, name):
    params = SETTINGS[name]
    counts = engine_draws(next_logits, **params)
    probs = stock_probs(next_logits, **params)
    assert (probs > 0.01).sum() >= 5, "the prompt's distribution is too peaked to test"
    assert chi_square_p(counts, probs) > ALPHA


def test_a_temperature_10_percent_off_is_rejected(next_logits):
    counts = engine_draws(next_logits, temperature=0.7)
    assert chi_square_p(counts, stock_probs(next_logits, temperature=0.77)) < ALPHA
    assert chi_square_p(counts, stock_probs(next_logits, temperature=0.63)) < ALPHA


def test_an_ignored_top_p_is_rejected(next_logits):
    counts = engine_draws(next_logits, temperature=0.9, top_p=0.8)
    assert chi_square_p(counts, stock_probs(next_logits, temperature=0.9)) < ALPHA
