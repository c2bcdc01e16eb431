"""What the runtime derives from a model's config before an engine starts: here, the longest
sequence a model whose rope frequencies follow the sequence length can be served to."""

from __future__ import annotations

import pytest

from hf_paged import LLM
from hf_paged.config import EngineConfig
from hf_paged.engine.runtime import resolve_runtime
from hf_paged.testing import build_hf_model, hf_greedy, make_prompts, paged_greedy

LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.5 * i for i in range(8)]}  # fmt: skip
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}


def test_longrope_engine_stops_at_the_switch_length(tmp_path):
    """Past original_max_position_embeddings stock switches to the long factors by its batch's
    longest row; a chunked 9-token prompt in the engine took them by the chunk (wrong tokens)
    when max_model_len allowed more. Now the engine ends there and a longer one is refused."""
    hf = build_hf_model("llama", seed=0, rope_parameters=LONGROPE, max_position_embeddings=64)
    hf.save_pretrained(tmp_path)
    prompts = make_prompts([9, 1], seed=3)
    kw = dict(kv_block_size=4, num_kv_blocks=16, max_num_batched_tokens=4, max_model_len=None)
    got, _ = paged_greedy(str(tmp_path), prompts, new_tokens=6, **kw)
    assert got == hf_greedy(hf, prompts, new_tokens=6)
    with pytest.raises(ValueError, match=r"max_model_len=64 .*'longrope'.*must be <= 16"):
        LLM(str(tmp_path), max_model_len=64)


def test_dynamic_rope_refuses_max_model_len_past_its_positions(tmp_path):
    hf = build_hf_model("llama", seed=0, rope_parameters=DYNAMIC, max_position_embeddings=16)
    hf.save_pretrained(tmp_path)
    assert resolve_runtime(str(tmp_path), EngineConfig()).max_model_len == 16
    with pytest.raises(ValueError, match=r"max_model_len=32 .*'dynamic'.*must be <= 16"):
        resolve_runtime(str(tmp_path), EngineConfig(max_model_len=32))
