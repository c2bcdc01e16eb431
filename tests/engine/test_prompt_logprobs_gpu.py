"""Prompt logprobs on one GPU (Triton prefill, chunked, prefix cache on): equal to log_softmax of
a stock HF forward in fp32, and the loglikelihood adapter's pieces end to end."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


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
