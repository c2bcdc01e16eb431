"""Proposers: prompt lookup proposes exactly what transformers' ``PromptLookupCandidateGenerator``
proposes (fuzzed over token lists, n-gram sizes, lengths and EOS), and backs off where nothing
is kept; a draft model proposes its own greedy continuation, again after its request was rolled
back to what the target kept, stops at EOS and below its confidence threshold, and follows
stock's ``num_assistant_tokens_schedule``."""

from __future__ import annotations

import random

import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

from hf_paged import LLM, SamplingParams
from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.spec.proposers import DraftModelProposer, NgramProposer, ProposalRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def item(tokens, max_tokens=64, stop=(), num_prompt=None, params=GREEDY) -> ProposalRequest:
    seq = Sequence(tokens[: num_prompt or len(tokens)], params)
    seq.token_ids = list(tokens)
    return ProposalRequest(seq, max_tokens, params, tuple(stop), None)


def stock_lookup(tokens, k, n, eos) -> list[int]:
    gen = PromptLookupCandidateGenerator(
        eos_token_id=None if eos is None else torch.tensor([eos]), num_output_tokens=k,
        max_matching_ngram_size=n, max_length=10_000,
    )  # fmt: skip
    ids = torch.tensor([tokens])
    cand, _ = gen.get_candidates(ids)
    return cand[0, len(tokens) :].tolist()


def test_prompt_lookup_proposes_what_stock_does():
    rng = random.Random(0)
    for case in range(400):
        vocab, length = rng.choice([3, 5, 20]), rng.randint(1, 40)
        tokens = [rng.randrange(vocab) for _ in range(length)]
        k, n = rng.randint(1, 6), rng.randint(1, 4)
        eos = rng.choice([None, 0, 1])
        got = NgramProposer(k, n, backoff=False).propose(
            [item(tokens, stop=() if eos is None else (eos,))]
        )[0]
        assert got.token_ids == stock_lookup(tokens, k, n, eos), (case, tokens, k, n, eos)
        assert got.probs is None


def test_prompt_lookup_index_follows_a_growing_sequence():
    """One proposer across steps (its index grows with the tokens) answers as a fresh one."""
    rng = random.Random(1)
    tokens = [rng.randrange(6) for _ in range(5)]
    prop = NgramProposer(4, 3, backoff=False)
    it = item(tokens)
    for _ in range(60):
        assert prop.propose([it])[0].token_ids == stock_lookup(it.seq.token_ids, 4, 3, None)
        it.seq.token_ids.extend(rng.randrange(6) for _ in range(rng.randint(1, 3)))
    assert prop.propose([item(tokens, max_tokens=2)])[0].token_ids == stock_lookup(
        tokens, 2, 3, None
    )  # a max_tokens cap


def test_prompt_lookup_backs_off_where_nothing_is_kept():
    prop = NgramProposer(3, 2)
    it = item([5, 6, 7, 5, 6])
    proposes, kept = [], iter([0, 0, 1, 2])  # per proposal: tokens kept
    for _ in range(1 + 3 + 1 + 15 + 2):
        got = prop.propose([it])[0].token_ids
        proposes.append(bool(got))
        if got:
            prop.observe(it.seq, len(got), next(kept))
    # a miss: skip 3 steps; a second miss in a row: skip 15; a kept token ends the back-off
    assert proposes == [True] + [False] * 3 + [True] + [False] * 15 + [True, True]
    prop.release(it.seq)
    assert not prop._index and not prop._misses and not prop._skip


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="num_tokens=0"):
        NgramProposer(0)
    with pytest.raises(ValueError, match="max_matching_ngram_size=0"):
        NgramProposer(3, 0)
    with pytest.raises(ValueError, match="schedule='fast'"):
        DraftModelProposer(None, 3, schedule="fast")
    with pytest.raises(ValueError, match="confidence_threshold=2"):
        DraftModelProposer(None, 3, confidence_threshold=2)


@pytest.fixture(scope="module")
def draft(spec_models):
    paths, _ = spec_models
    with LLM(paths["far"], max_model_len=128, kv_block_size=4, num_kv_blocks=64) as llm:
        yield llm


def draft_greedy(llm, tokens, n) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    return llm.generate([tokens], params, use_tqdm=False)[0].token_ids


def test_a_draft_model_proposes_its_greedy_continuation_after_each_rollback(draft):
    eng = draft.engine
    prop = DraftModelProposer(eng, num_tokens=5)
    rng = random.Random(2)
    it = item([rng.randrange(3, 256) for _ in range(9)])
    for _ in range(6):
        got = prop.propose([it])[0]
        assert got.token_ids == draft_greedy(draft, it.seq.token_ids, 5) and got.probs is None
        # the target keeps some of it and adds a token of its own (or keeps none)
        keep = rng.randint(0, 5)
        it.seq.token_ids.extend(got.token_ids[:keep] + [rng.randrange(3, 256)])
    prop.release(it.seq)
    eng.step()  # collects the aborted request
    assert not eng.has_unfinished_requests()
    assert eng.block_manager.num_free_blocks == eng.runtime.num_kv_blocks


def test_a_draft_stops_at_eos_and_below_its_confidence(draft):
    eng = draft.engine
    tokens = [7, 8, 9, 10, 11]
    cont = draft_greedy(draft, tokens, 6)
    cases = [  # (proposer, item, expected proposal)
        (DraftModelProposer(eng, 6), item(tokens, stop=(cont[3],)),
         cont[: cont.index(cont[3])]),  # stock's draft stops at EOS: a proposal ends before it
        (DraftModelProposer(eng, 6, confidence_threshold=1.0), item(tokens), cont[:1]),
        (DraftModelProposer(eng, 6), item(tokens, max_tokens=2), cont[:2]),
    ]  # fmt: skip
    for prop, it, expected in cases:
        assert prop.propose([it])[0].token_ids == expected
        prop.release(it.seq)
    eng.step()
    assert eng.block_manager.num_free_blocks == eng.runtime.num_kv_blocks


@pytest.mark.parametrize("schedule", ["constant", "heuristic"])
def test_the_assistant_token_schedule(draft, schedule):
    prop = DraftModelProposer(draft.engine, 4, schedule=schedule)
    it = item([20, 21, 22, 23, 24])
    lengths = []
    for kept_all in (True, True, False, False):
        k = len(prop.propose([it])[0].token_ids)
        lengths.append(k)
        prop.observe(it.seq, k, k if kept_all else 0)
        it.seq.token_ids.append(5)
    prop.release(it.seq)
    assert lengths == ([4, 4, 4, 4] if schedule == "constant" else [4, 6, 8, 7])


def test_a_sampled_request_gets_draft_probabilities(draft):
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=64, seed=3)
    it = item([30, 31, 32, 33], params=params)
    it.generator = torch.Generator().manual_seed(3)
    prop = DraftModelProposer(draft.engine, 3)
    got = prop.propose([it])[0]
    prop.release(it.seq)
    assert got.probs.shape == (3, 256)
    torch.testing.assert_close(got.probs.sum(-1), torch.ones(3))
    assert ((got.probs > 0).sum(-1) <= 20).all()  # top-k applied to the draft distribution
    assert all(got.probs[j, t] > 0 for j, t in enumerate(got.token_ids))
