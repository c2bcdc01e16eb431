"""The hybrid and recurrent families, CPU fp32: each family's tiny
model (its own fields, ``hf_paged.testing.hybrid_configs``), saved and reloaded through its
safetensors, is greedy-identical to stock on each prompt alone (1 to 70 tokens, 16 new) in one
batched, left-padded ``generate(backend="paged")`` call; the same with a cramped engine
(prefill chunks of 16 tokens, a KV budget that forces preemption); seeded sampling after
preemption equals the engine's own unconstrained run. A family whose recurrent layers have no
mixer yet is skipped with the class named.

The hybrid families on CUDA (fp32, the torch mixers): one batched left-padded
``generate(backend="paged")`` call greedy-identical to stock on each prompt alone, decode steps in
CUDA graphs (persistent slot buffers), and the same with a cramped engine (16-token prefill
chunks, preemption). A cuda_family transformers lacks here skips with its name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams, release
from hf_paged.models.recurrent import registry
from hf_paged.testing import build_tiny
from hf_paged.testing.hybrid_configs import HYBRID_FAMILIES, MORE_HYBRID_FAMILIES
from hf_paged.testing.hybrid_oracle import NEW_TOKENS, hybrid_prompts, paged_batched, stock_alone
from hf_paged.testing.markers import marked

# ---- on any device --------------------------------------------------------------------------------


BASE = dict(kv_block_size=4, max_model_len=96)


# 8 prompts need 84 blocks of 4 tokens in all; 30 hold about a third: preemption is certain
CRAMPED = dict(BASE, max_num_batched_tokens=16, num_kv_blocks=30)


@pytest.fixture(scope="module", params=HYBRID_FAMILIES + MORE_HYBRID_FAMILIES)
def family(request, tmp_path_factory):
    config, model = build_tiny(request.param)
    missing = registry.unserved({type(m).__name__ for _, m in registry.recurrent_modules(model)})
    if missing:
        pytest.skip(f"no mixer for {', '.join(missing)} yet")
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = hybrid_prompts(config.get_text_config().vocab_size)
    ref = stock_alone(model, prompts, NEW_TOKENS)
    yield request.param, path, model, prompts, ref
    release(model)


def _preemptions(model) -> int:
    from hf_paged.integration.engine_owner import existing_owner

    return existing_owner(model).engine.stats["num_preemptions"]


def test_batched_greedy_equals_each_prompt_alone(family):
    _, _, model, prompts, ref = family
    rows, fell = paged_batched(model, prompts, BASE)
    assert fell == []
    assert rows == ref
    release(model)


def test_cramped_engine_equals_each_prompt_alone(family):
    _, _, model, prompts, ref = family
    rows, fell = paged_batched(model, prompts, CRAMPED)
    assert fell == []
    assert _preemptions(model) > 0
    assert rows == ref
    release(model)


def test_seeded_sampling_after_preemption(family):
    _, path, _, prompts, _ = family
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=NEW_TOKENS,
                             min_tokens=NEW_TOKENS) for i in range(len(prompts))]  # fmt: skip
    with LLM(path, **BASE) as llm:
        free = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats["num_preemptions"] == 0
    with LLM(path, **CRAMPED) as llm:
        cramped = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats
    assert stats["num_preemptions"] > 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    assert cramped == free


# ---- on CUDA --------------------------------------------------------------------------------------


_MARKS_HYBRID_ON_DEVICE = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs one CUDA device"),
]


CUDA_BASE = dict(device="cuda", kv_block_size=16, max_model_len=96)


CUDA_CRAMPED = dict(CUDA_BASE, max_num_batched_tokens=16, num_kv_blocks=10)


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def cuda_family(request):
    from transformers import CONFIG_MAPPING

    if request.param not in CONFIG_MAPPING:
        pytest.skip(f"{request.param} is not in this transformers")
    config, model = build_tiny(request.param)
    missing = registry.unserved({type(m).__name__ for _, m in registry.recurrent_modules(model)})
    if missing:
        pytest.skip(f"no mixer for {', '.join(missing)} yet")
    model = model.to("cuda")
    prompts = hybrid_prompts(config.get_text_config().vocab_size)
    yield model, prompts, stock_alone(model, prompts, NEW_TOKENS)
    release(model)


def _runner(model):
    from hf_paged.integration.engine_owner import existing_owner

    return existing_owner(model).engine.executor.runner


@marked(_MARKS_HYBRID_ON_DEVICE)
def test_batched_greedy_equals_alone_with_decode_graphs(cuda_family):
    model, prompts, ref = cuda_family
    rows, fell = paged_batched(model, prompts, CUDA_BASE)
    assert fell == []
    runner = _runner(model)
    assert runner.cuda_graph_reason is None and runner.graph_runner is not None
    assert runner.graph_runner.state_pool is runner.state_pool
    assert rows == ref
    release(model)


@marked(_MARKS_HYBRID_ON_DEVICE)
def test_cramped_engine_equals_alone(cuda_family):
    model, prompts, ref = cuda_family
    rows, fell = paged_batched(model, prompts, CUDA_CRAMPED)
    assert fell == []
    from hf_paged.integration.engine_owner import existing_owner

    assert existing_owner(model).engine.stats["num_preemptions"] > 0
    assert rows == ref
    release(model)
