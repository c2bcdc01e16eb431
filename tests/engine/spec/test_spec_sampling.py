"""Sampling with speculation has the target's distribution: on a toy vocabulary of 8 tokens, 600
seeded requests of 4 new tokens each, drawn with a draft model (speculative sampling: accept with
min(1, p/q), else the residual) and with prompt lookup (the target's own draws matched). The
first token comes from the prefill; the step after it verifies 2 proposed tokens for every
request (the prompt holds every token with two after it, so lookup always proposes), so
rejections at both positions and the token after a fully kept proposal all occur. The counts
of each pair of consecutive tokens are tested against the target's exact distribution (from
the HF model, over all 4,096 continuations) by chi-square; they are far from the draft's (the
test can tell them apart), and a seed gives the same tokens alone or in a batch."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.spec.proposers import DraftModelProposer, NgramProposer
from hf_paged.testing import build_hf_model

V, NEW, N = 8, 4, 600
PROMPT = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]  # any next token t occurs before with 2 tokens after it
ENGINE = dict(max_model_len=32, kv_block_size=4, num_kv_blocks=2048, max_num_seqs=256)


def exact(model) -> dict[tuple[int, ...], float]:
    """P(continuation) for every NEW-token continuation of PROMPT at temperature 1."""
    probs = {(): 1.0}
    for _ in range(NEW):
        seqs = list(probs)
        with torch.no_grad():
            logits = model(torch.tensor([PROMPT + list(s) for s in seqs])).logits[:, -1]
        rows = logits.float().softmax(-1).tolist()
        probs = {s + (t,): probs[s] * row[t] for s, row in zip(seqs, rows) for t in range(V)}
    return probs


def pairs(dist: dict, j: int) -> dict:
    """The distribution (or counts) of tokens (j, j + 1)."""
    out: dict = {}
    for s, p in dist.items():
        out[s[j : j + 2]] = out.get(s[j : j + 2], 0) + p
    return out


def chi_square_p(counts: dict, probs: dict) -> float:
    """Pearson's test over the outcomes (expected counts under 5 merged into one cell)."""
    n = sum(counts.values())
    stat, df, rest_e, rest_o = 0.0, -1, 0.0, 0
    for s, p in probs.items():
        e, o = p * n, counts.get(s, 0)
        if e < 5:
            rest_e, rest_o = rest_e + e, rest_o + o
        else:
            stat, df = stat + (o - e) ** 2 / e, df + 1
    if rest_e > 0:
        stat, df = stat + (rest_o - rest_e) ** 2 / rest_e, df + 1
    x = torch.tensor([df / 2, stat / 2], dtype=torch.float64)
    return float(torch.special.gammaincc(x[0], x[1]))


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_vocab")
    target = build_hf_model("llama", 0, vocab_size=V)
    draft = build_hf_model("llama", 5, vocab_size=V, num_hidden_layers=1)
    target.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    with LLM(str(root / "target"), **ENGINE) as llm, LLM(str(root / "draft"), **ENGINE) as d:
        yield llm, d.engine, exact(target), exact(draft)


def sample(llm, proposer, seeds) -> list[tuple[int, ...]]:
    params = [SamplingParams(temperature=1.0, max_tokens=NEW, ignore_eos=True, seed=s)
              for s in seeds]  # fmt: skip
    outs = llm.generate([PROMPT] * len(seeds), params, use_tqdm=False, proposer=proposer)
    assert all(len(o.token_ids) == NEW for o in outs)
    return [tuple(o.token_ids) for o in outs]


def count(outcomes) -> dict:
    counts: dict = {}
    for o in outcomes:
        counts[o] = counts.get(o, 0) + 1
    return counts


@pytest.mark.parametrize("kind", ["draft", "ngram"])
def test_speculative_sampling_has_the_targets_distribution(toy, kind):
    llm, draft_engine, p_target, p_draft = toy
    assert sum(p_target.values()) == pytest.approx(1.0)
    assert sum(abs(p_target[s] - p_draft[s]) for s in p_target) / 2 > 0.3  # models differ
    proposer = (DraftModelProposer(draft_engine, num_tokens=2) if kind == "draft"
                else NgramProposer(2, backoff=False))  # fmt: skip
    before = dict(llm.stats)
    counts = count(sample(llm, proposer, range(N)))
    drafted = llm.stats["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    kept = llm.stats["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    assert drafted >= 2 * N and 50 < kept < 0.9 * drafted  # both outcomes, many times
    for j in range(NEW - 1):
        assert chi_square_p(pairs(counts, j), pairs(p_target, j)) > 1e-3 / (NEW - 1), j
        assert chi_square_p(pairs(counts, j), pairs(p_draft, j)) < 1e-9


def test_a_seed_gives_the_same_tokens_alone_or_in_a_batch(toy):
    llm, draft_engine, _, _ = toy
    proposer = DraftModelProposer(draft_engine, num_tokens=2)
    seeds = [11, 12, 13, 14, 15, 16]
    batch = sample(llm, proposer, seeds)
    assert batch == [sample(llm, proposer, [s])[0] for s in seeds]
