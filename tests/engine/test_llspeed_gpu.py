"""lm-eval speed paths on one GPU: prompt-logprob requests take overlapped stepping and give
what synchronous stepping gives (fp32), and continuations of a context share it through the
prefix cache under overlapped stepping (the scheduler's hold-back plus blocks registered at
launch)."""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing import save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


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
