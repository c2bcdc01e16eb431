"""A tiny Qwen3.5 (Gated DeltaNet + attention) and a tiny Mamba2 (SSD layers only) through the
real safetensors path and every entry point: ``LLM(path)``,
``AutoPagedModelForCausalLM.from_pretrained(path)`` and ``pipeline(..., backend="paged")``, each
greedy-identical to stock on each prompt alone."""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_paged import LLM, AutoPagedModelForCausalLM
from hf_paged.integration.fallback import PagedFallbackWarning
from hf_paged.integration.pipeline import (
    install_pipeline,
    is_pipeline_installed,
    uninstall_pipeline,
)
from hf_paged.testing import TINY_VOCAB, build_tiny, hf_greedy, left_pad, tiny_tokenizer
from hf_paged.testing.hybrid_oracle import NEW_TOKENS, hybrid_prompts

ENGINE = dict(kv_block_size=4, max_model_len=96, num_kv_blocks=200, max_num_batched_tokens=16)
TEXTS = ["Hello, my name is", "ab", "The capital of France is", "def fib(n):"]


@pytest.fixture(scope="module", params=["qwen3_5_text", "mamba2"])
def ckpt(request, tmp_path_factory):
    _, model = build_tiny(request.param, vocab_size=TINY_VOCAB)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = hybrid_prompts(TINY_VOCAB, seed=3)
    return path, stock, prompts, hf_greedy(stock, prompts, NEW_TOKENS)


def test_llm_from_path(ckpt):
    path, _, prompts, ref = ckpt
    from hf_paged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with LLM(path, **ENGINE) as llm:
        out = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats
    assert out == ref
    assert stats["num_state_slots"] > 0 and stats["state_pool_bytes"] > 0


def test_auto_paged_model(ckpt):
    path, _, prompts, ref = ckpt
    model = AutoPagedModelForCausalLM.from_pretrained(path, **ENGINE)
    try:
        ids, mask = left_pad(prompts)
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # fmt: skip
    finally:
        model.close()
    assert out[:, ids.shape[1] :].tolist() == ref


def test_pipeline(ckpt):
    path, stock, _, _ = ckpt
    was = is_pipeline_installed()
    install_pipeline()
    try:
        tok = AutoTokenizer.from_pretrained(path)
        greedy = dict(max_new_tokens=8, do_sample=False, return_full_text=False)
        pipe = transformers.pipeline("text-generation", model=path, backend="paged",
                                     paged_config=dict(ENGINE, device="cpu"), device="cpu")  # fmt: skip
        try:
            with warnings.catch_warnings():  # served by the engine, not a stock fallback
                warnings.simplefilter("error", PagedFallbackWarning)
                paged = [r[0]["generated_text"] for r in pipe(TEXTS, batch_size=2, **greedy)]
            assert pipe.model.engine.stats["num_state_slots"] > 0
        finally:
            pipe.model.close()
    finally:
        if not was:
            uninstall_pipeline()
    alone = []
    for text in TEXTS:
        enc = tok(text, return_tensors="pt")
        with torch.no_grad():
            out = stock.generate(**enc, max_new_tokens=8, do_sample=False)
        alone.append(tok.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True))
    assert paged == alone
    assert len(set(paged)) > 1
