"""Prompt logprobs at tp=2 over gloo equal tp=1's: every rank runs the vocab-parallel LM head on
the same scored rows (it gathers), and rank 0 scores them."""

from __future__ import annotations

import random

from hf_paged import LLM, SamplingParams
from hf_paged.testing import save_tiny_model


def test_tp2_prompt_logprobs_match_tp1(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"), seed=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (1, 9, 30, 47)]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2)
    kwargs = dict(max_model_len=96, kv_block_size=8, num_kv_blocks=64, max_num_batched_tokens=24)
    with LLM(path, **kwargs) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **kwargs) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    for r, g in zip(ref, got):
        assert g.token_ids == r.token_ids
        assert len(g.prompt_logprobs) == len(r.prompt_logprobs)
        for a, b in zip(r.prompt_logprobs[1:], g.prompt_logprobs[1:]):
            assert (a.token_id, a.rank, list(a.top)) == (b.token_id, b.rank, list(b.top))
            assert abs(a.logprob - b.logprob) < 1e-5
