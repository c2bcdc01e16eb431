"""Deferred rope on the generic path (``models/generic/rope.py``): for models whose rope is
Llama's, the paged attention layer rotates q/k (one launch with the KV write on CUDA). Greedy
tokens stay stock's; a model that touches q after rope keeps HF's own rotation; stock models in
the same process are unaffected."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.models.generic import rope
from hf_paged.testing import build_tiny, hf_greedy

PROMPTS = [[3, 5, 7, 9, 11], [4], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
NEW = 12


def stock(model, prompts):
    return hf_greedy(model, prompts, new_tokens=NEW)


def paged(model, prompts, **kw):
    llm = LLM(model, model_impl="generic", kv_block_size=4, max_model_len=64, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        state = llm.engine.executor.runner.model.state
        return [o.outputs[0].token_ids for o in outs], state
    finally:
        llm.close()


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "diffllama"])
def test_deferred_rope_is_on_and_tokens_are_stock(model_type):
    _, model = build_tiny(model_type)
    got, state = paged(model, PROMPTS, max_num_batched_tokens=8)
    assert state.defer_rope and state.rope_calls > 0
    assert got == stock(model, PROMPTS)


def test_fused_off_keeps_hf_rope(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FUSED", "0")
    from hf_paged import envs

    envs.reset()
    try:
        _, model = build_tiny("llama")
        got, state = paged(model, PROMPTS)
        assert not state.defer_rope
        assert got == stock(model, PROMPTS)
    finally:
        monkeypatch.delenv("HF_PAGED_FUSED")
        envs.reset()


def test_q_touched_after_rope_is_not_deferred(monkeypatch):
    """An attention forward that scales q after rope (a new tensor reaches attention): the
    profile pass sees it and leaves the rotation to HF."""
    from transformers.models.llama import modeling_llama as llama

    lines = textwrap.dedent(inspect.getsource(llama.LlamaAttention.forward)).splitlines()
    at = next(i for i, line in enumerate(lines) if "= apply_rotary_pos_emb(" in line)
    indent = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
    lines.insert(at + 1, f"{indent}query_states = query_states * 2.0")
    src = "\n".join(lines) + "\n"
    _, model = build_tiny("llama")
    rope.install(model)  # the wrapped apply_rotary_pos_emb is in the globals copied below
    scope = dict(vars(llama))
    exec(src, scope)  # noqa: S102  the same forward with one line added
    monkeypatch.setattr(llama.LlamaAttention, "forward", scope["forward"])
    got, state = paged(model, PROMPTS)
    assert state.rope_calls > 0 and state.rope_mismatch and not state.defer_rope
    assert got == stock(model, PROMPTS)


def test_wrapper_outside_a_step_is_the_original():
    from transformers.models.llama import modeling_llama as llama

    _, model = build_tiny("llama")
    assert rope.install(model) == ["transformers.models.llama.modeling_llama"]
    fn = llama.apply_rotary_pos_emb
    assert getattr(fn, "_hf_paged_deferred_rope", False)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    cos, sin = torch.randn(1, 3, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    for got, want in zip(fn(q, k, cos, sin), fn.__wrapped__(q, k, cos, sin)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
