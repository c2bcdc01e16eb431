"""Greedy parity of the engine with stock HF ``generate`` on tiny fp32 models of each family,
under default budgets, KV pressure (preemption), chunked prefill and prefix caching."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import hf_greedy, paged_greedy, save_tiny_model, spread_prompts
from hf_paged.testing.parity import MAX_MODEL_LEN, NEW_TOKENS

# (family, config overrides); tied and untied embeddings, GQA and MQA, rope scaling, window
VARIANTS = {
    "llama3_rope": ("llama3_rope", {"tie_word_embeddings": False}),
    "llama_linear_tied": ("llama", {"tie_word_embeddings": True,
                                    "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}}),
    "mistral_window": ("mistral", {"sliding_window": 12}),
    "qwen2_bias_mqa": ("qwen2", {"num_key_value_heads": 1}),
    "qwen2_sliding_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 10,
                                       "max_window_layers": 1}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_model(family, path, seed=0, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def test_defaults(variant):
    path, hf = variant
    prompts = spread_prompts(16, 2, 40, seed=1)
    got, _ = paged_greedy(path, prompts)
    assert got == hf_greedy(hf, prompts)


def test_preemption(variant):
    path, hf = variant
    prompts = spread_prompts(16, 2, 40, seed=2)
    # 16 blocks of 8 = exactly max_model_len: far less than 16 sequences need at once
    got, stats = paged_greedy(path, prompts, num_kv_blocks=MAX_MODEL_LEN // 8)
    assert stats["num_preemptions"] > 0
    assert got == hf_greedy(hf, prompts)


def test_chunked_prefill(variant):
    path, hf = variant
    prompts = spread_prompts(16, 7, 40, seed=3)  # every prompt longer than the budget
    got, _ = paged_greedy(path, prompts, max_num_batched_tokens=6, max_num_seqs=6)
    assert got == hf_greedy(hf, prompts)


def test_prefix_caching(variant):
    path, hf = variant
    shared = [7 + (i * 13) % 240 for i in range(20)]
    prompts = spread_prompts(16, 1, 12, seed=5, prefix=shared)
    on, stats = paged_greedy(path, prompts, enable_prefix_caching=True, max_num_seqs=4)
    off, _ = paged_greedy(path, prompts, enable_prefix_caching=False, max_num_seqs=4)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert on == off == hf_greedy(hf, prompts)


@pytest.mark.parametrize("block_size", [4, 8])
def test_block_boundaries_and_repeated_prompts(variant, block_size):
    """Prompt lengths at block edges; identical prompts (whole-prompt cache hits, capped so at
    least one token is computed); a second pass over the same prompts hits the cache again."""
    path, hf = variant
    base = [3 + (i * 37) % 250 for i in range(4 * block_size + 1)]
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 4 * block_size + 1]
    prompts = [base[:n] for n in lengths] * 2  # every prompt twice
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with LLM(path, max_model_len=MAX_MODEL_LEN, kv_block_size=block_size, num_kv_blocks=512,
             max_num_seqs=3) as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats["prefix_cache_hit_tokens"] > 0
    ref = hf_greedy(hf, prompts[: len(lengths)])
    assert first == second == ref + ref
