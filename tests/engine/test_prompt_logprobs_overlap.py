"""Prompt logprobs under overlapped stepping (``async_scheduling=True``): the same entries as
synchronous stepping and as a stock forward (fp32), with chunked prefill, preemption and shared
prefixes; the steps really overlap; an abort mid-prefill leaves nothing behind."""

from __future__ import annotations

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.testing import make_prompts
from tests.engine.logprob_checks import check, run

CASES = {
    "defaults": ([1, 7, 33, 60], dict(max_tokens=3, prompt_logprobs=2), {}),
    "chunked": ([70, 41, 13, 100], dict(max_tokens=4, prompt_logprobs=0),
                dict(max_num_batched_tokens=16, max_num_seqs=4)),
    "preempt": ([50, 60, 37, 55, 44, 58], dict(max_tokens=30, min_tokens=30, prompt_logprobs=3),
                dict(num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=6)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_async_equals_sync_and_stock(logprob_model, case):
    path, hf = logprob_model
    lens, p, engine = CASES[case]
    prompts = make_prompts(lens, seed=len(case))
    params = SamplingParams(temperature=0.0, **p)
    sync, _ = run(path, prompts, params, async_scheduling=False, **engine)
    ours, stats = run(path, prompts, params, async_scheduling=True, **engine)
    assert stats["num_overlapped_steps"] > 0
    if case == "preempt":
        assert stats["num_preemptions"] > 0
    for prompt, a, b in zip(prompts, ours, sync, strict=True):
        assert a.prompt_logprobs == b.prompt_logprobs and a.token_ids == b.token_ids
        check(hf, prompt, a.prompt_logprobs, p["prompt_logprobs"])


def test_async_continuations_share_the_context(logprob_model):
    """The loglikelihood pattern in one call: the first continuation of a context prefills it,
    the others wait for its blocks, registered at launch, and take them from the cache."""
    path, hf = logprob_model
    contexts = make_prompts([40, 27], seed=8)
    prompts = [c + t for c in contexts for t in make_prompts([3, 9, 1], seed=len(c))]
    outs, hits = [], []
    for overlap in (False, True):
        with LLM(path, max_model_len=128, kv_block_size=8, num_kv_blocks=64,
                 async_scheduling=overlap) as llm:  # fmt: skip
            params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0,
                                     prompt_logprobs_start=len(contexts[i // 3]))
                      for i in range(len(prompts))]  # fmt: skip
            outs.append(llm.generate(prompts, params, use_tqdm=False))
            hits.append(llm.stats["prefix_cache_hit_tokens"])
    # row len(ctx) - 1 is scored: blocks before it are shared (40 -> 32 tokens, 27 -> 24)
    assert hits == [2 * 32 + 2 * 24] * 2
    for i, (a, b) in enumerate(zip(*outs, strict=True)):
        assert a.prompt_logprobs == b.prompt_logprobs
        check(hf, prompts[i], a.prompt_logprobs, 0, start=len(contexts[i // 3]))


def test_async_abort_mid_prefill(logprob_model):
    path, _ = logprob_model
    prompt = make_prompts([100], seed=9)[0]
    with LLM(path, max_model_len=128, kv_block_size=8, num_kv_blocks=64,
             max_num_batched_tokens=16, async_scheduling=True) as llm:  # fmt: skip
        eng = llm.engine
        rid = eng.add_request(
            EngineRequest(prompt, SamplingParams(max_tokens=2, prompt_logprobs=1))
        )
        eng.step()
        eng.step()  # two chunks launched, scores of the first resolved
        eng.abort(rid)
        done = []
        while eng.has_unfinished_requests():
            done.extend(eng.step().finished)
        assert [o.finish_reason for o in done] == ["abort"]
        eng.step()  # resolves what was in flight for the aborted request
        assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]
