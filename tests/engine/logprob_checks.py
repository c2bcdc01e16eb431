"""Prompt-logprob checks shared by the synchronous and overlapped tests: the engine's entries
against ``log_softmax`` of a stock HF forward, and one ``LLM`` run that returns every KV block."""

from __future__ import annotations

import torch

from hf_paged import LLM
from hf_paged.engine.core.outputs import PromptLogprob

TOL = 1e-5


def hf_scores(hf, prompt: list[int]) -> torch.Tensor:
    """[P - 1, V] fp32 log_softmax of stock logits; row p scores prompt token p + 1."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def check(hf, prompt: list[int], entries, k: int, start: int = 1) -> None:
    assert len(entries) == len(prompt)
    assert all(e is None for e in entries[:start])
    lp = hf_scores(hf, prompt)
    for p in range(start, len(prompt)):
        e = entries[p]
        assert isinstance(e, PromptLogprob) and e.token_id == prompt[p]
        row = lp[p - 1]
        assert abs(e.logprob - row[prompt[p]].item()) < TOL, (p, e.logprob)
        # rank 1 <=> stock's argmax (lm-eval's is_greedy)
        assert (e.rank == 1) == (row.argmax().item() == prompt[p])
        assert e.rank == 1 + int((row > row[prompt[p]]).sum())
        top_v, top_i = row.topk(k)
        assert list(e.top) == top_i.tolist()
        assert torch.allclose(torch.tensor(list(e.top.values())), top_v, atol=TOL)
        assert e.as_dict()[prompt[p]] == e.logprob and len(e.as_dict()) in (k, k + 1)


def run(path, prompts, params, **engine_kwargs):
    kwargs = dict(max_model_len=128, kv_block_size=8, num_kv_blocks=256)
    kwargs.update(engine_kwargs)
    with LLM(path, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = dict(llm.stats)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    return outs, stats
