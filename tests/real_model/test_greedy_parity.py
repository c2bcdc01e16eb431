"""Greedy decoding of the demo model (real weights, fp32, prefix caching on) equals stock's, on
16 chat prompts of 36 to 219 tokens that share the chat template's system turn: through
``generate(backend="paged")`` alone and left-padded in one batch, a text-generation pipeline and
``LLM``. The oracle is each prompt run alone through stock ``generate``."""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing.chat_prompts import QUESTIONS, chat_ids

pytestmark = pytest.mark.real_model

NEW = 24  # new tokens per prompt: long enough for answers to diverge if a logit is off
PICK = list(range(12)) + [16, 17, 18, 21]  # short questions and ones carrying paragraphs


@pytest.fixture(scope="module")
def prompts(demo_tokenizer):
    return chat_ids(demo_tokenizer, [QUESTIONS[i] for i in PICK])


@pytest.fixture(scope="module")
def expected(stock_fp32, prompts):
    """Stock's new tokens of each prompt run alone (ending at EOS when it comes)."""
    outs = []
    for ids in prompts:
        out = stock_fp32.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
        outs.append(out[0, len(ids) :].tolist())
    return outs


def _until_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def test_generate_alone_equals_stock(stock_fp32, prompts, expected):
    for ids, want in zip(prompts, expected):
        x = torch.tensor([ids])
        got = stock_fp32.generate(x, max_new_tokens=NEW, do_sample=False, backend="paged")
        assert got[0, len(ids) :].tolist() == want


def test_generate_batched_equals_stock_alone(stock_fp32, demo_tokenizer, prompts, expected):
    eos = stock_fp32.generation_config.eos_token_id
    demo_tokenizer.padding_side = "left"
    batch = demo_tokenizer.pad({"input_ids": prompts}, return_tensors="pt")
    got = stock_fp32.generate(**batch, max_new_tokens=NEW, do_sample=False, backend="paged")
    width = batch["input_ids"].shape[1]
    assert got.shape[0] == len(prompts)
    for row, want in zip(got[:, width:].tolist(), expected):
        assert _until_eos(row, eos) == want


def test_pipeline_equals_stock(stock_fp32, demo_tokenizer, expected):
    from transformers import pipeline

    pipe = pipeline("text-generation", model=stock_fp32, tokenizer=demo_tokenizer)
    chats = [[{"role": "user", "content": QUESTIONS[i]}] for i in PICK]
    outs = pipe(chats, max_new_tokens=NEW, do_sample=False, backend="paged", batch_size=1)
    for out, want in zip(outs, expected):
        text = demo_tokenizer.decode(want, skip_special_tokens=True)
        assert out[0]["generated_text"][-1]["content"] == text


def test_llm_with_prefix_caching_equals_stock(demo_model_dir, prompts, expected):
    from hf_paged import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW, skip_special_tokens=False)
    with LLM(demo_model_dir, dtype="float32", enable_prefix_caching=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        hits = llm.engine.stats["prefix_cache_hit_tokens"]
    assert hits > 0  # the system turn was shared: the cached path ran
    for out, want in zip(outs, expected):
        assert list(out.outputs[0].token_ids) == want
