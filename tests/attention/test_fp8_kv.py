"""``kv_cache_dtype="fp8"``: float8_e4m3fn K/V (scale 1.0) on the torch reference backend.
The block count doubles against bf16 (quadruples against fp32) for the same bytes, and the
outputs stay close to a model-dtype cache: the agreement is measured (and printed), not
asserted equal; a loose floor catches a broken cache."""

from __future__ import annotations

import random

import pytest
import torch

from hf_paged import LLM, EngineConfig, SamplingParams
from hf_paged.attention.kv_cache import KVCache, KVCacheSpec
from hf_paged.kernels.attention.kv_store import store_kvcache_ref
from hf_paged.testing import save_tiny_model


def test_config_key_is_validated():
    assert EngineConfig().kv_cache_dtype == "auto"
    assert EngineConfig(kv_cache_dtype="fp8_e4m3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match=r"kv_cache_dtype='int8' is not allowed: .*'fp8'"):
        EngineConfig(kv_cache_dtype="int8")


def test_fp8_blocks_cost_half_the_bytes_of_bf16():
    specs = [KVCacheSpec(2, 64, 64), KVCacheSpec(2, 192, 128)]
    bf16 = KVCache.block_bytes(specs, 16, torch.bfloat16)
    assert KVCache.block_bytes(specs, 16, torch.float8_e4m3fn) * 2 == bf16


def test_reference_store_clamps_into_range():
    k = torch.tensor([[[1000.0, -1000.0, 0.3, 2.0]]])
    cache = torch.zeros(2, 4, 1, 4, dtype=torch.float8_e4m3fn)
    store_kvcache_ref(k, k, cache, cache.clone(), torch.tensor([5]))
    assert cache.view(-1, 1, 4)[5].float().tolist() == [[448.0, -448.0, 0.3125, 2.0]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return save_tiny_model("qwen3", str(tmp_path_factory.mktemp("kv8")), seed=4)


def test_fp8_kv_on_the_reference_backend(qwen3):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 40))] for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = dict(max_model_len=96, kv_block_size=8, kv_cache_bytes=1 << 20)
    out, blocks = {}, {}
    for kv in ("auto", "fp8"):
        with LLM(qwen3, kv_cache_dtype=kv, **engine) as llm:
            out[kv] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            blocks[kv] = llm.stats["num_kv_blocks"]
            cache = llm.engine.executor.runner.kv_cache
            assert cache.dtype == (torch.float8_e4m3fn if kv == "fp8" else torch.float32)
    assert blocks["fp8"] == 4 * blocks["auto"]  # fp32 model: a quarter of the bytes per block
    pairs = [(a, b) for x, y in zip(out["auto"], out["fp8"]) for a, b in zip(x, y)]
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    first = sum(x[0] == y[0] for x, y in zip(out["auto"], out["fp8"])) / len(prompts)
    print(f"fp8 KV vs fp32 KV: greedy token agreement {agreement:.3f}, first tokens {first:.3f}")
    assert first >= 0.75 and agreement > 0.5  # close, not equal: e4m3 keeps 3 mantissa bits
