"""``SamplingParams(prompt_logprobs=k)``: equal to ``log_softmax`` of a stock HF forward over the
prompt (fp32, 1e-5), with chunked prefill, prefix caching, preemption, k = 0 and k = 5."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import make_prompts, save_tiny_model
from tests.engine.logprob_checks import check, run


@pytest.mark.parametrize("k", [0, 5])
def test_matches_stock_forward(logprob_model, k):
    path, hf = logprob_model
    prompts = make_prompts([1, 2, 7, 8, 9, 33, 60], seed=k)
    params = SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=k)
    outs, _ = run(path, prompts, params)
    assert outs[0].prompt_logprobs == [None]  # prompt length 1
    for p, o in zip(prompts, outs):
        check(hf, p, o.prompt_logprobs, k)
        assert len(o.token_ids) == 3


def test_mixed_k_in_one_step(logprob_model):
    """Requests with k = 0, 1 and 4 (and one without prompt logprobs) share steps: the step
    packs the largest k and each request gets its own k alternatives."""
    path, hf = logprob_model
    prompts = make_prompts([12, 30, 7, 21], seed=11)
    ks = [4, 0, None, 1]
    params = [SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=k) for k in ks]
    outs, _ = run(path, prompts, params)
    for p, o, k in zip(prompts, outs, ks):
        if k is None:
            assert o.prompt_logprobs is None
        else:
            check(hf, p, o.prompt_logprobs, k)


def test_k_over_the_vocabulary_gives_all_of_it(logprob_model):
    """k past the vocabulary is capped at it, as the sampler's ``logprobs`` are (it raised
    'selected index k out of range' from the step), beside a request with a small k."""
    path, hf = logprob_model
    vocab = hf.config.vocab_size
    prompts = make_prompts([9, 6], seed=3)
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=k, logprobs=k)
              for k in (10**6, 2)]  # fmt: skip
    outs, _ = run(path, prompts, params)
    check(hf, prompts[0], outs[0].prompt_logprobs, vocab)
    check(hf, prompts[1], outs[1].prompt_logprobs, 2)
    assert len(outs[0].outputs[0].logprobs[0][1]) == vocab


def test_not_asked_is_none(logprob_model):
    outs, _ = run(logprob_model[0], make_prompts([5], 0), SamplingParams(max_tokens=2))
    assert outs[0].prompt_logprobs is None


def test_chunked_prefill(logprob_model):
    """Prompts longer than the step budget are scored across several chunks, each chunk's
    last row scoring the next chunk's first token."""
    path, hf = logprob_model
    prompts = make_prompts([70, 41, 13, 100], seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    outs, _ = run(path, prompts, params, max_num_batched_tokens=16, max_num_seqs=4)
    for p, o in zip(prompts, outs):
        check(hf, p, o.prompt_logprobs, 2)


def test_prefix_cache_hit_still_scores(logprob_model):
    """A repeated prompt (in one call and across calls) gets full logprobs: the scoring request
    takes no cached block for rows it must score."""
    path, hf = logprob_model
    prompt = make_prompts([45], seed=4)[0]
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    with LLM(path, max_model_len=128, kv_block_size=8, num_kv_blocks=64) as llm:
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # fill the cache
        assert llm.stats["prefix_cache_hit_tokens"] == 0
        outs = llm.generate([prompt, prompt], params, use_tqdm=False)
        again = llm.generate([prompt], params, use_tqdm=False)
        hits = llm.stats["prefix_cache_hit_tokens"]
    for o in outs + again:
        check(hf, prompt, o.prompt_logprobs, 1)
    assert hits == 0  # start=1 scores row 0 on: nothing before it may come from the cache


def test_start_shares_the_prefix(logprob_model):
    """With prompt_logprobs_start, tokens before the first scored row come from the prefix
    cache (the loglikelihood pattern: one context, several continuations)."""
    path, hf = logprob_model
    context = make_prompts([40], seed=5)[0]
    prompts = make_prompts([3, 9, 1, 12], seed=6, prefix=context)
    with LLM(path, max_model_len=128, kv_block_size=8, num_kv_blocks=64) as llm:
        llm.generate([context], SamplingParams(max_tokens=1), use_tqdm=False)
        params = SamplingParams(
            temperature=0.0, max_tokens=1, prompt_logprobs=0, prompt_logprobs_start=len(context)
        )
        outs = llm.generate(prompts, params, use_tqdm=False)
        hits = llm.stats["prefix_cache_hit_tokens"]
    for p, o in zip(prompts, outs):
        check(hf, p, o.prompt_logprobs, 0, start=len(context))
    # row len(context) - 1 = 39 is scored, so blocks [0, 32) may be shared: 4 blocks each
    assert hits == 4 * 32


def test_preemption_no_duplicates(logprob_model):
    """Under KV pressure sequences are preempted mid-prefill and mid-decode and recomputed;
    every prompt still gets exactly one entry per token, equal to stock."""
    path, hf = logprob_model
    prompts = make_prompts([50, 60, 37, 55, 44, 58], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=40, min_tokens=40, prompt_logprobs=3)
    outs, stats = run(
        path, prompts, params, num_kv_blocks=24, max_num_batched_tokens=32, max_num_seqs=6
    )
    assert stats["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        check(hf, p, o.prompt_logprobs, 3)
        assert len(o.token_ids) == 40


def test_bad_values():
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(ValueError, match="prompt_logprobs_start"):
        SamplingParams(prompt_logprobs=0, prompt_logprobs_start=0)


# ---- on one GPU (marker ``gpu``; skipped without CUDA by tests/engine/conftest.py) ----
# Prompt logprobs on one GPU (Triton prefill, chunked, prefix cache on): equal to log_softmax of a
# stock HF forward in fp32, and the loglikelihood adapter's pieces end to end.


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["llama3_rope", "qwen3"])
@pytest.mark.parametrize("chunk", [8192, 24])
def test_prompt_logprobs_match_stock_cuda(tmp_path, family, chunk):
    path = save_tiny_model(family, str(tmp_path / family), seed=0)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    rng = random.Random(0)
    ps = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 2, 16, 17, 33, 60, 100)]
    ps.append(list(ps[-1]))  # a repeated prompt
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=3)
    with LLM(path, dtype="float32", max_num_batched_tokens=chunk, enforce_eager=False) as llm:
        outs = llm.generate(ps, params, use_tqdm=False)
    for p, o in zip(ps, outs):
        assert len(o.prompt_logprobs) == len(p) and o.prompt_logprobs[0] is None
        if len(p) == 1:
            continue
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p], device="cuda")).logits[0, :-1].float(), -1)
        got = torch.tensor([e.logprob for e in o.prompt_logprobs[1:]])
        want = lp.gather(1, torch.tensor(p[1:], device="cuda")[:, None])[:, 0].cpu()
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        assert [e.rank == 1 for e in o.prompt_logprobs[1:]] == (
            lp.argmax(-1).cpu() == torch.tensor(p[1:])
        ).tolist()


# ---- on one GPU (marker ``gpu``; skipped without CUDA by tests/engine/conftest.py) ----
# lm-eval speed paths on one GPU: prompt-logprob requests take overlapped stepping and give what
# synchronous stepping gives (fp32), and continuations of a context share it through the prefix
# cache under overlapped stepping (the scheduler's hold-back plus blocks registered at launch).


@pytest.mark.gpu
def test_prompt_logprobs_overlapped_equal_sync_cuda(tmp_path):
    path = save_tiny_model("qwen3", str(tmp_path / "m"), seed=0)
    rng = random.Random(0)
    contexts = [[rng.randrange(3, 256) for _ in range(n)] for n in (40, 70, 33)]
    prompts = [c + [rng.randrange(3, 256) for _ in range(rng.randint(2, 9))]
               for c in contexts for _ in range(4)]  # fmt: skip
    params = [SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=2,
                             prompt_logprobs_start=len(contexts[i // 4]))
              for i in range(len(prompts))]  # fmt: skip
    outs, stats = [], []
    for overlap in (False, True):
        with LLM(path, dtype="float32", kv_block_size=16, max_num_batched_tokens=64,
                 async_scheduling=overlap) as llm:  # fmt: skip
            outs.append(llm.generate(prompts, params, use_tqdm=False))
            stats.append(dict(llm.stats))
    assert stats[1]["num_overlapped_steps"] > 0 and stats[0]["num_overlapped_steps"] == 0
    # 3 of the 4 continuations of each context take its full blocks before row len(ctx) - 1
    want = 3 * sum((len(c) - 1) // 16 * 16 for c in contexts)
    assert [s["prefix_cache_hit_tokens"] for s in stats] == [want, want]
    for a, b in zip(*outs, strict=True):
        for x, y in zip(a.prompt_logprobs, b.prompt_logprobs, strict=True):
            assert (x is None) == (y is None)
            if x is not None:
                assert abs(x.logprob - y.logprob) < 1e-4 and x.rank == y.rank
