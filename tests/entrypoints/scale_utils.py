"""Shared by the scale-out tests: a tiny checkpoint, row prompts, and the single-process oracle."""

from __future__ import annotations

import random

from hf_paged import LLM, SamplingParams
from hf_paged.entrypoints.rows import row_params
from hf_paged.testing import save_demo_model

# small KV pool and batches: every engine of these tests fits in a few MiB
ENGINE = dict(max_model_len=64, kv_block_size=8, num_kv_blocks=96, max_num_seqs=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SAMPLED = SamplingParams(temperature=1.0, top_k=20, max_tokens=6)


def make_model(root) -> str:
    """The demo model (qwen3 family, hidden 64, 2 layers, char tokenizer) under ``root``."""
    return save_demo_model(str(root / "model"), seed=3)


def text_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct prompts of 1 to 30 characters (1 and the block boundaries included)."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz ,."
    lengths = [1, 7, 8, 9, 16, 17] + [rng.randint(1, 30) for _ in range(n)]
    out = []
    for i in range(n):
        body = "".join(rng.choice(letters) for _ in range(lengths[i]))
        out.append(f"{i}{body}"[: max(1, lengths[i])])
    return out


def reference(model: str, prompts: list[str], ids: list, params, seed: int = 0) -> dict:
    """Single-process hf_paged: row id -> generated token ids, with the same per-row seeds."""
    with LLM(model, **ENGINE) as llm:
        outs = llm.generate(prompts, row_params(params, seed, ids), use_tqdm=False)
    return {rid: list(o.token_ids) for rid, o in zip(ids, outs)}
