"""Shared pieces of the NCCL tensor-parallel tests: a random fp32 model far from argmax ties,
prompts with a shared prefix, an engine config small enough to preempt, and a device-count skip."""

from __future__ import annotations

import math
import random

import pytest
import torch

from hf_paged.testing import tiny_config

# 16 heads: divisible by 4 ranks; intermediate 2816 = 4 x 704
SIZES = dict(
    hidden_size=1024, intermediate_size=2816, num_hidden_layers=4, num_attention_heads=16,
    vocab_size=1024, max_position_embeddings=512,
)  # fmt: skip
ENGINE = dict(dtype="float32", max_model_len=256, num_kv_blocks=40, kv_block_size=16,
              max_num_seqs=16, max_num_batched_tokens=256)  # fmt: skip


def needs_gpus(n: int):
    """A skip mark for tests that need ``n`` CUDA devices."""
    have = torch.cuda.device_count()
    return pytest.mark.skipif(have < n, reason=f"needs {n} CUDA devices, found {have}")


def save_model(family: str, path: str, **overrides) -> str:
    """A random fp32 model with weights scaled 1/sqrt(fan_in), so logits are far from ties."""
    from transformers import AutoModelForCausalLM

    overrides = {**SIZES, **overrides}
    if family == "qwen3":
        overrides.setdefault("head_dim", 64)
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


def prompts(n: int = 15, seed: int = 0) -> list[list[int]]:
    """A length-1 prompt, then ``n`` prompts sharing a 40-token prefix (prefix-cache hits)."""
    rng = random.Random(seed)
    shared = [rng.randrange(3, 1024) for _ in range(40)]
    tails = [[rng.randrange(3, 1024) for _ in range(rng.randint(1, 60))] for _ in range(n)]
    return [[5]] + [shared + t for t in tails]
