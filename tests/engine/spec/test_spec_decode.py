"""Speculative decoding on the engine, greedy, fp32: prompt lookup, a draft model and a scripted
proposer give exactly stock's plain greedy tokens, at batch sizes 1 and 8, with blocks of 4 tokens
(every verified chunk and most prompts cross a block edge), a rejection at every position of the
proposal, preemption in the middle of speculative steps (tight KV, target and draft), prefix
caching, per-position repetition penalty, stop ids inside a kept run, n > 1 and logprobs."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.engine.core.block_manager import hash_block
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.spec.proposers import DraftModelProposer, NgramProposer, Proposal
from hf_paged.testing import save_tiny_model

NEW = 24
ENGINE = dict(max_model_len=128, kv_block_size=4, num_kv_blocks=256, max_num_seqs=8)


def prompts(n: int, seed: int) -> list[list[int]]:
    """Prompts with repeats (so lookups find something), lengths around block edges."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(3, 6))]
        tail = [rng.randrange(3, 256) for _ in range(i % 5)]
        out.append((motif * 3 + tail)[: 7 + 3 * i])
    return out


def stock_greedy(hf, batch, new=NEW, **kw) -> list[list[int]]:
    """Stock non-assisted greedy, one prompt at a time, EOS never stops it."""
    outs = []
    for p in batch:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)  # fmt: skip
        outs.append(seq[0, len(p) :].tolist())
    return outs


def greedy(new=NEW, **kw) -> SamplingParams:
    """As ``stock_greedy``: EOS masked until ``new`` tokens (``min_tokens``, per position)."""
    return SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, **kw)


def run(llm, batch, params, proposer):
    outs = llm.generate(batch, params, use_tqdm=False, proposer=proposer)
    assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]  # every block back
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def target(spec_models):
    paths, hf = spec_models
    with LLM(paths["target"], **ENGINE) as llm:
        yield llm, hf


@pytest.fixture(scope="module")
def near_draft(spec_models):
    with LLM(spec_models[0]["near"], **ENGINE) as llm:
        yield llm.engine


def spec_delta(llm, before: dict) -> tuple[int, int]:
    s = llm.stats
    return (s["spec_num_draft_tokens"] - before["spec_num_draft_tokens"],
            s["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"])  # fmt: skip


@pytest.mark.parametrize("batch_size", [1, 8])
def test_prompt_lookup_is_stock_greedy(target, batch_size):
    llm, hf = target
    batch = prompts(batch_size, seed=batch_size)
    before = dict(llm.stats)
    got = run(llm, batch, greedy(), NgramProposer(5, backoff=False))
    assert got == stock_greedy(hf, batch)
    drafted, kept = spec_delta(llm, before)
    assert drafted > 0 and kept > 0  # lookups were made and some were kept


@pytest.mark.parametrize("batch_size", [1, 8])
def test_draft_model_is_stock_greedy(target, near_draft, batch_size):
    llm, hf = target
    batch = prompts(batch_size, seed=10 + batch_size)
    before = dict(llm.stats)
    proposer = DraftModelProposer(near_draft, num_tokens=6)
    got = run(llm, batch, greedy(), proposer)
    assert got == stock_greedy(hf, batch)
    drafted, kept = spec_delta(llm, before)
    assert 0 < kept < drafted  # kept runs and rejections both happened
    assert near_draft.block_manager.num_free_blocks == near_draft.runtime.num_kv_blocks


class ScriptedProposer:
    """Proposes the reference continuation with a wrong token at position ``r``: request i's
    j-th proposal uses ``r = (i + j) % (k + 1)`` (``r = k``: all right), so every position of a
    proposal is rejected somewhere and requests keep different counts in the same step."""

    def __init__(self, refs: dict[tuple, list[int]], k: int):
        self.refs, self.k = refs, k
        self.calls: dict[int, int] = {}
        self.expected_kept = 0
        self.seen_positions: set[int] = set()

    def propose(self, items):
        out = []
        for it in items:
            seq = it.seq
            prompt = tuple(seq.token_ids[: seq.num_prompt_tokens])
            ref, done = self.refs[prompt], seq.num_output_tokens
            assert seq.output_token_ids == ref[:done]  # the engine kept exactly the right tokens
            j = self.calls[seq.seq_id] = self.calls.get(seq.seq_id, -1) + 1
            order = sorted(self.refs).index(prompt)
            r, k = (order + j) % (self.k + 1), min(self.k, it.max_tokens)
            right = ref[done : done + k]
            tokens = right[:r] + [(t + 1) % 256 for t in right[r:]]
            self.expected_kept += min(r, k)
            if r < k:
                self.seen_positions.add(r)
            out.append(Proposal(tokens))
        return out

    def observe(self, seq, num_proposed, num_accepted):
        pass

    def release(self, seq):
        pass


@pytest.mark.parametrize("batch_size", [1, 8])
def test_a_rejection_at_every_position(target, batch_size):
    llm, hf = target
    batch = prompts(batch_size, seed=20 + batch_size)
    ref = stock_greedy(hf, batch)
    proposer = ScriptedProposer({tuple(p): r for p, r in zip(batch, ref)}, k=5)
    before = dict(llm.stats)
    assert run(llm, batch, greedy(), proposer) == ref
    drafted, kept = spec_delta(llm, before)
    assert kept == proposer.expected_kept and drafted > kept
    assert proposer.seen_positions == set(range(5))


def test_preemption_in_the_middle_of_speculative_steps(spec_models):
    """Target and draft with a pool of 32 blocks of 4 tokens for 8 requests of up to 52
    tokens: target sequences are preempted with proposals in hand (and recomputed), the draft
    engine drafts for as many as it can hold at once and rolls its requests back after each
    verification; every block of both comes back."""
    paths, hf = spec_models
    batch = prompts(8, seed=30)
    ref = stock_greedy(hf, batch)
    tight = dict(ENGINE, num_kv_blocks=32)
    with LLM(paths["target"], **tight) as llm, LLM(paths["near"], **tight) as draft:
        got = run(llm, batch, greedy(), NgramProposer(6, backoff=False))
        assert llm.stats["num_preemptions"] > 0 and llm.stats["spec_num_accepted_tokens"] > 0
        assert got == ref
        before = dict(llm.stats)
        got = run(llm, batch, greedy(), DraftModelProposer(draft.engine, num_tokens=6))
        assert llm.stats["num_preemptions"] > before["num_preemptions"]
        assert got == ref
        assert draft.stats["num_free_blocks"] == draft.stats["num_kv_blocks"]


def test_prefix_cache_holds_only_kept_tokens(target):
    """Every block the prefix cache holds after speculative runs is a full block of some final
    sequence (prompt + output; nothing was cut by a stop): no rejected token was cached.
    A second pass over the same prompts hits the cache and gives the same tokens."""
    llm, hf = target
    llm.reset_prefix_cache()
    batch = prompts(8, seed=40)
    first = run(llm, batch, greedy(), NgramProposer(5, backoff=False))
    bm = llm.engine.block_manager
    chains = set()
    for p, o in zip(batch, first):
        toks, parent = p + o, None
        for i in range(len(toks) // bm.block_size):
            parent = hash_block(parent, tuple(toks[i * bm.block_size : (i + 1) * bm.block_size]))
            chains.add(parent)
    assert bm._cached and set(bm._cached) <= chains
    hits = llm.stats["prefix_cache_hit_tokens"]
    assert run(llm, batch, greedy(), NgramProposer(5, backoff=False)) == first
    assert llm.stats["prefix_cache_hit_tokens"] > hits
    assert first == stock_greedy(hf, batch)


def test_repetition_penalty_reads_each_positions_history(target, near_draft):
    """Stock applies its processors to each verified position with the tokens before it; a
    penalty that read the whole proposal (or none of it) would change tokens here."""
    llm, hf = target
    batch = prompts(4, seed=50)
    ref = stock_greedy(hf, batch, repetition_penalty=1.5)
    params = greedy(repetition_penalty=1.5)
    assert run(llm, batch, params, NgramProposer(5, backoff=False)) == ref
    assert run(llm, batch, params, DraftModelProposer(near_draft, num_tokens=5)) == ref


def test_a_stop_id_inside_a_kept_run_ends_the_request_there(target, near_draft):
    llm, hf = target
    batch = prompts(6, seed=60)
    plain = run(llm, batch, SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True), None)
    stop = plain[0][9]  # a token the first request emits after a few steps
    params = SamplingParams(temperature=0.0, max_tokens=NEW, stop_token_ids=(stop,),
                            ignore_eos=True)  # fmt: skip
    expected = [o[: o.index(stop) + 1] if stop in o else o for o in plain]
    for proposer in (NgramProposer(6, backoff=False), DraftModelProposer(near_draft, 6)):
        outs = llm.generate(batch, params, use_tqdm=False, proposer=proposer)
        assert [o.token_ids for o in outs] == expected
        assert [o.finish_reason for o in outs] == ["stop" if stop in o else "length" for o in plain]


def test_n_samples_and_logprobs(target, near_draft):
    llm, hf = target
    batch = prompts(3, seed=70)
    params = greedy(n=2, logprobs=2)
    plain = llm.generate(batch, params, use_tqdm=False)
    ref = stock_greedy(hf, batch)
    for proposer in (NgramProposer(5, backoff=False), DraftModelProposer(near_draft, 5)):
        outs = llm.generate(batch, params, use_tqdm=False, proposer=proposer)
        for o, p, r in zip(outs, plain, ref):
            assert [c.token_ids for c in o.outputs] == [r, r]
            for c, pc in zip(o.outputs, p.outputs):
                assert len(c.logprobs) == NEW
                for (lp, top), (plp, ptop) in zip(c.logprobs, pc.logprobs):
                    assert lp == pytest.approx(plp, abs=1e-4) and top.keys() == ptop.keys()


def test_reset_tokens_keeps_the_common_prefix_kv(target):
    """The draft side's rollback: an external request rewritten to other tokens keeps the KV
    of the common prefix (but for the last token), frees the rest and reports the logits after
    the new last token, equal to a fresh request's."""
    llm, _ = target
    eng = llm.engine
    prompt = list(range(10, 19))  # 9 tokens
    rid = eng.add_request(
        EngineRequest(prompt, SamplingParams(max_tokens=1), external_sampling=True)
    )
    while not eng.awaits_token(rid):
        eng.step()
    seq = eng.requests.by_id[rid].seqs[0]
    for t in (40, 41, 42, 43, 44):
        eng.provide_token(rid, t)
        while not eng.awaits_token(rid):
            eng.step()
    assert (len(seq), seq.num_computed_tokens, len(seq.block_table)) == (14, 14, 4)
    new = prompt + [40, 41, 42, 43, 7]  # keeps 13 tokens' KV, one new token
    eng.reset_tokens(rid, new)
    assert seq.token_ids == new and (seq.num_computed_tokens, len(seq.block_table)) == (13, 4)
    # back inside block 2 (positions 8..11, full, so in the prefix cache): not written into,
    # its tokens are computed again in a block of the request's own
    new = prompt + [40, 9]
    eng.reset_tokens(rid, new)
    assert seq.token_ids == new and (seq.num_computed_tokens, len(seq.block_table)) == (8, 2)
    res = eng.step()
    fresh = eng.add_request(
        EngineRequest(new, SamplingParams(max_tokens=1), external_sampling=True)
    )
    res2 = eng.step()
    torch.testing.assert_close(res.logits[(rid, 0)], res2.logits[(fresh, 0)], atol=1e-4, rtol=1e-4)
    assert eng.awaits_token(rid) and seq.num_computed_tokens == 11
    eng.reset_tokens(rid, new)  # the same tokens: the last one is computed again
    assert seq.num_computed_tokens == 10 and not eng.awaits_token(rid)
    with pytest.raises(ValueError, match="must start with its prompt"):
        eng.reset_tokens(rid, [1, 2, 3])
    eng.abort(rid)
    eng.abort(fresh)
    eng.step()
    assert not eng.has_unfinished_requests()


def test_a_proposal_outside_the_vocabulary_is_named(target):
    llm, _ = target

    class Bad(ScriptedProposer):
        def propose(self, items):
            return [Proposal([3, 999]) for _ in items]

    with pytest.raises(ValueError, match=r"Bad proposed \[3, 999\]: token ids must be ints"):
        llm.generate([[5, 6, 7]], greedy(), use_tqdm=False, proposer=Bad({}, 2))
    assert not llm.engine.has_unfinished_requests()
    assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]


# ---- on one GPU (marker ``gpu``; skipped without CUDA by tests/engine/conftest.py) ----
# Speculative decoding on one GPU: the verification chunks run through the Triton prefill kernel
# (blocks of 16) next to CUDA-graph decodes of plain requests in the same engine; fp32 greedy
# is stock's greedy (prompt lookup and a draft engine on the same GPU, also with
# preemption), and bf16 speculative greedy matches the engine's own bf16 greedy but for
# rare near-ties.


GPU_NEW = 32
GPU_ENGINE = dict(max_model_len=256, kv_block_size=16, num_kv_blocks=256, max_num_seqs=16)


def gpu_prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(3, 9))]
        out.append((motif * 4)[: 10 + 5 * i])
    return out


@pytest.fixture(scope="module")
def gpu_paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_gpu")
    target = save_tiny_model("llama", str(root / "target"), seed=0)
    draft = save_tiny_model("llama", str(root / "draft"), seed=0, num_hidden_layers=1)
    return target, draft


def gpu_stock(path, batch) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = []
    for p in batch:
        ids = torch.tensor([p], device="cuda")
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GPU_NEW,
                          min_new_tokens=GPU_NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(seq[0, len(p) :].tolist())
    return out


def gpu_greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=GPU_NEW, min_tokens=GPU_NEW)


@pytest.mark.gpu
@pytest.mark.parametrize("num_kv_blocks", [256, 24])  # 24: preemption
def test_fp32_speculative_greedy_is_stock_greedy(gpu_paths, num_kv_blocks):
    target, draft = gpu_paths
    batch = gpu_prompts(8, seed=num_kv_blocks)
    ref = gpu_stock(target, batch)
    cfg = dict(GPU_ENGINE, dtype="float32", num_kv_blocks=num_kv_blocks)
    with LLM(target, **cfg) as llm, LLM(draft, **dict(cfg, num_kv_blocks=256)) as d:
        assert llm.engine.executor.runner.attn_backend.name == "triton"
        for proposer in (NgramProposer(8, backoff=False), DraftModelProposer(d, 6)):
            outs = llm.generate(batch, gpu_greedy(), use_tqdm=False, proposer=proposer)
            assert [o.token_ids for o in outs] == ref
        assert llm.stats["spec_num_accepted_tokens"] > 0
        assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]
        if num_kv_blocks == 24:
            assert llm.stats["num_preemptions"] > 0


@pytest.mark.gpu
def test_spec_and_plain_requests_share_steps(gpu_paths):
    """Requests with and without a proposer in one engine run (the plain ones decode in the
    same synchronous steps); both kinds give their plain greedy tokens."""
    target, _ = gpu_paths
    batch = gpu_prompts(12, seed=3)
    with LLM(target, **dict(GPU_ENGINE, dtype="float32")) as llm:
        plain = [o.token_ids for o in llm.generate(batch, gpu_greedy(), use_tqdm=False)]
        eng, prop = llm.engine, NgramProposer(8, backoff=False)
        rids = [eng.add_request(EngineRequest(p, gpu_greedy(), proposer=prop if i % 2 else None))
                for i, p in enumerate(batch)]  # fmt: skip
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in eng.step().finished)
        assert [done[r] for r in rids] == plain


@pytest.mark.gpu
def test_bf16_speculative_greedy_matches_the_engines_greedy(gpu_paths):
    target, _ = gpu_paths
    batch = gpu_prompts(16, seed=4)
    with LLM(target, **dict(GPU_ENGINE, dtype="bfloat16")) as llm:
        plain = [o.token_ids for o in llm.generate(batch, gpu_greedy(), use_tqdm=False)]
        spec = llm.generate(batch, gpu_greedy(), use_tqdm=False, proposer=NgramProposer(8))
    same = sum(a == b.token_ids for a, b in zip(plain, spec))
    assert same >= len(batch) - 2, f"only {same}/{len(batch)} identical"
