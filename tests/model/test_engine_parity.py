"""Greedy parity of the engine with stock HF ``generate`` on tiny fp32 models of each family,
under default budgets, KV pressure (preemption), chunked prefill and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import save_tiny_model

NEW_TOKENS = 32
MAX_LEN = 128
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


def make_prompts(n: int, lo: int, hi: int, seed: int, prefix: list[int] | None = None):
    rng = random.Random(seed)
    lens = [1, hi, lo] + [rng.randint(lo, hi) for _ in range(n - 3)]
    return [(prefix or []) + [rng.randrange(3, 256) for _ in range(k)] for k in lens[:n]]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_model(family, path, seed=0, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Stock generate, one prompt at a time (no padding), EOS never stops it."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        outs.append(seq[0, len(p) :].tolist())
    return outs


def paged_greedy(path, prompts, new_tokens: int = NEW_TOKENS, **engine_kwargs):
    """``path``: a checkpoint dir or an in-memory HF model; ``engine_kwargs`` override the
    defaults below."""
    # min_tokens masks EOS like HF min_new_tokens, so both run the full new_tokens
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    kwargs = dict(max_model_len=MAX_LEN, kv_block_size=8, num_kv_blocks=256)
    kwargs.update(engine_kwargs)
    with LLM(path, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = dict(llm.stats)
    assert all(o.finish_reason == "length" and len(o.token_ids) == new_tokens for o in outs)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]  # every block back
    return [o.token_ids for o in outs], stats


def test_defaults(variant):
    path, hf = variant
    prompts = make_prompts(16, 2, 40, seed=1)
    got, _ = paged_greedy(path, prompts)
    assert got == hf_greedy(hf, prompts)


def test_preemption(variant):
    path, hf = variant
    prompts = make_prompts(16, 2, 40, seed=2)
    # 16 blocks of 8 = exactly max_model_len: far less than 16 sequences need at once
    got, stats = paged_greedy(path, prompts, num_kv_blocks=MAX_LEN // 8)
    assert stats["num_preemptions"] > 0
    assert got == hf_greedy(hf, prompts)


def test_chunked_prefill(variant):
    path, hf = variant
    prompts = make_prompts(16, 7, 40, seed=3)  # every prompt longer than the budget
    got, _ = paged_greedy(path, prompts, max_num_batched_tokens=6, max_num_seqs=6)
    assert got == hf_greedy(hf, prompts)


def test_prefix_caching(variant):
    path, hf = variant
    shared = [7 + (i * 13) % 240 for i in range(20)]
    prompts = make_prompts(16, 1, 12, seed=5, prefix=shared)
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
    with LLM(path, max_model_len=MAX_LEN, kv_block_size=block_size, num_kv_blocks=512,
             max_num_seqs=3) as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats["prefix_cache_hit_tokens"] > 0
    ref = hf_greedy(hf, prompts[: len(lengths)])
    assert first == second == ref + ref
