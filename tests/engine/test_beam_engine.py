"""Beam-search requests on a real engine (tiny fp32 llama): ``provide_beams`` forks beams that
share KV blocks, copy-on-write keeps every beam's logits equal to the HF model's own on the same
tokens (also when beams are parked for lack of KV and recomputed), dropped beams free their
blocks, bad calls change nothing; and the KV blocks of 8 beams on a 1,000-token prompt."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.spec.proposers import NgramProposer
from hf_paged.integration import dispatch
from hf_paged.testing import build_hf_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=32)


@pytest.fixture(scope="module")
def hf():
    torch.set_num_threads(1)
    return build_hf_model("llama", seed=0)


def make_engine(hf, **overrides) -> LLMEngine:
    config = dict(num_kv_blocks=64, kv_block_size=4, max_num_batched_tokens=32, max_num_seqs=8,
                  max_model_len=64)  # fmt: skip
    return LLMEngine(hf, {**config, **overrides})


def logits_of(engine: LLMEngine, want: set, max_steps: int = 64) -> dict:
    """Step until every ``(request_id, beam)`` in ``want`` has reported its logits."""
    got = {}
    for _ in range(max_steps):
        if want <= got.keys():
            return got
        got.update({k: v for k, v in engine.step().logits.items() if k in want})
    assert want <= got.keys(), want - got.keys()
    return got


def hf_next_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def assert_refs_consistent(engine: LLMEngine) -> None:
    """Each block's ref count is the number of live sequences holding it."""
    bm = engine.block_manager
    held = [0] * bm.num_blocks
    for req in engine.requests.by_id.values():
        for seq in req.seqs:
            if not seq.is_finished:
                for b in seq.block_table:
                    held[b] += 1
    assert held == bm.ref_counts


# parents, chosen so that beams are continued twice, dropped, and cross block boundaries (the
# prompt has 6 tokens: its last block is shared half full when the first beams fork)
ROUNDS = [[0, 0, 0], [2, 2, 0], [1, 0, 0], [0, 1, 2], [2, 2, 2], [0, 0, 1], [1, 2, 0]]


@pytest.mark.parametrize("kv", ["roomy", "tight"])
def test_forked_beams_compute_what_the_model_computes_on_their_tokens(hf, kv):
    # tight: two requests' beams do not fit at once, so paused beams get parked and recomputed
    engine = make_engine(hf, num_kv_blocks=64 if kv == "roomy" else 9, max_model_len=32)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(6)], [rng.randrange(3, 256) for _ in range(9)]]
    rids = [engine.add_request(EngineRequest(p, PARAMS, external_sampling=True, beam_search=True))
            for p in prompts]  # fmt: skip
    beams = {rid: [list(p)] for rid, p in zip(rids, prompts)}
    got = logits_of(engine, {(rid, 0) for rid in rids})
    for parents in ROUNDS:
        for rid in rids:
            for j, toks in enumerate(beams[rid]):
                torch.testing.assert_close(got[(rid, j)], hf_next_logits(hf, toks), atol=1e-4,
                                           rtol=1e-4)  # fmt: skip
        tokens = [[rng.randrange(3, 256) for _ in parents] for _ in rids]
        engine.provide_beams(rids, [parents] * len(rids), tokens)
        for rid, toks in zip(rids, tokens):
            beams[rid] = [beams[rid][p] + [t] for p, t in zip(parents, toks)]
            assert [s.token_ids for s in engine.requests.by_id[rid].seqs] == beams[rid]
        assert_refs_consistent(engine)
        got = logits_of(engine, {(rid, j) for rid in rids for j in range(len(parents))})
        assert_refs_consistent(engine)
    assert engine.stats["num_copied_blocks"] > 0
    if kv == "tight":
        assert engine.stats["num_parked"] > 0 and engine.stats["num_preemptions"] > 0
    for rid in rids:
        engine.abort(rid)
    finished = engine.step().finished
    assert sorted(o.request_id for o in finished) == sorted(rids)
    assert engine.block_manager.num_free_blocks == engine.runtime.num_kv_blocks
    assert not engine.has_unfinished_requests()
    engine.close()


def test_provide_beams_refuses_bad_calls_and_changes_nothing(hf):
    engine = make_engine(hf)
    beam = engine.add_request(
        EngineRequest([5, 6, 7], PARAMS, external_sampling=True, beam_search=True)
    )
    plain = engine.add_request(EngineRequest([5, 6, 7], PARAMS, external_sampling=True))
    with pytest.raises(ValueError, match="not a beam-search request"):
        engine.provide_beams([plain], [[0]], [[3]])
    with pytest.raises(ValueError, match="not every beam is waiting"):
        engine.provide_beams([beam], [[0]], [[3]])  # its logits are not computed yet
    logits_of(engine, {(beam, 0)})
    seq = engine.requests.by_id[beam].seqs[0]
    before = (list(seq.token_ids), list(engine.block_manager.ref_counts))
    bad = {
        "parents must be in": ([[1]], [[3]]),
        "token ids in": ([[0]], [[256]]),
        "equal, non-zero lengths": ([[0, 0]], [[3]]),
    }
    for match, (parents, tokens) in bad.items():
        with pytest.raises(ValueError, match=match):
            engine.provide_beams([beam], parents, tokens)
    with pytest.raises(ValueError, match="ids must differ"):
        engine.provide_beams([beam, beam], [[0], [0]], [[3], [3]])
    with pytest.raises(ValueError, match="without external_sampling"):
        engine.add_request(EngineRequest([5], PARAMS, beam_search=True))
    with pytest.raises(ValueError, match="beams do not speculate"):  # no rollback of beams
        engine.add_request(EngineRequest([5], PARAMS, external_sampling=True, beam_search=True,
                           proposer=NgramProposer(2)))  # fmt: skip
    with pytest.raises(ValueError, match="provide_token is not allowed .* beam search"):
        engine.provide_token(beam, 3)  # one token for which beam?
    with pytest.raises(ValueError, match="reset_tokens is not allowed .* beam search"):
        engine.reset_tokens(beam, [5, 6, 7, 3])
    assert (seq.token_ids, engine.block_manager.ref_counts) == before
    engine.provide_beams([beam], [[0, 0]], [[3, 4]])  # a good call still works
    assert [s.token_ids for s in engine.requests.by_id[beam].seqs] == [[5, 6, 7, 3], [5, 6, 7, 4]]
    engine.close()


def test_eight_beams_on_a_1000_token_prompt_hold_at_most_1_3x_one_sequences_blocks():
    """Measured from the block manager at every ``provide_beams`` of a real beam-search call,
    i.e. once the beams' logits for the step are in and all their tokens have KV: the first
    time (after the prefill) the request is one sequence; then 8 beams of 1,000 + n tokens,
    n = 1..32, against ``ceil((1000 + n) / 16)`` blocks for one sequence."""
    torch.set_num_threads(1)
    model = build_hf_model("llama", seed=0, max_position_embeddings=1100)
    dispatch.configure(model, num_kv_blocks=200, kv_block_size=16, max_num_batched_tokens=1024,
                       max_num_seqs=8, seed=0)  # fmt: skip
    try:
        engine = dispatch.get_engine(model)
        bm, provide = engine.block_manager, engine.provide_beams
        used = []

        def measuring(*args, **kwargs):
            used.append(bm.num_blocks - bm.num_free_blocks)
            return provide(*args, **kwargs)

        engine.provide_beams = measuring
        prompt = torch.tensor([[random.Random(1).randrange(3, 256) for _ in range(1000)]])
        model.generate(input_ids=prompt, max_new_tokens=34, num_beams=8, backend="paged")
        assert len(used) == 33
        one = [math.ceil((1000 + n) / 16) for n in range(len(used))]
        assert used[0] == one[0] == 63  # after the prefill: one sequence
        assert used[1] == 62 + 8  # 62 shared full blocks, each beam its copy of the 63rd
        ratios = [u / o for u, o in zip(used, one)]
        assert max(ratios) <= 1.3, ratios
        assert bm.num_free_blocks == bm.num_blocks  # all freed after the call
    finally:
        dispatch.release(model)
