"""Tensor parallelism over NCCL on two GPUs: greedy tokens equal tp=1 in fp32."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing import tiny_config

pytestmark = pytest.mark.multi_gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)


def save_model(family: str, path: str, **overrides) -> str:
    """A random fp32 model with weights scaled 1/sqrt(fan_in), so logits are far from ties."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif p.dim() == 2:
                std = 1.0 if "embed" in name else 1.0 / math.sqrt(p.shape[1])
                p.normal_(0.0, std)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("family, kv_heads", [("llama", 4), ("qwen3", 1)])
def test_nccl_tp2_matches_tp1(tmp_path, family, kv_heads):
    overrides = dict(
        hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
        num_key_value_heads=kv_heads, vocab_size=1024, max_position_embeddings=512,
    )  # fmt: skip
    if family == "qwen3":
        overrides["head_dim"] = 64
    path = save_model(family, str(tmp_path / family), **overrides)
    rng = random.Random(0)
    shared = [rng.randrange(3, 1024) for _ in range(40)]
    prompts = [[5]] + [shared + [rng.randrange(3, 1024) for _ in range(rng.randint(1, 60))]
                       for _ in range(15)]  # fmt: skip
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    cfg = dict(dtype="float32", max_model_len=256, num_kv_blocks=40, kv_block_size=16,
               max_num_seqs=16, max_num_batched_tokens=256)  # fmt: skip
    with LLM(path, **cfg) as llm:
        ref = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **cfg) as llm:
        assert llm.engine.executor.runner.comm.world_size == 2
        got = [o.token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        stats = llm.stats
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert got == ref
