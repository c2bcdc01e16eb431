"""The hybrid families on CUDA (fp32, the torch mixers): one batched left-padded
``generate(backend="paged")`` call greedy-identical to stock on each prompt alone, decode steps in
CUDA graphs (persistent slot buffers), and the same with a cramped engine (16-token prefill
chunks, preemption). A family transformers lacks here skips with its name."""

from __future__ import annotations

import pytest
import torch

from hf_paged import release
from hf_paged.models.recurrent import registry
from hf_paged.testing import build_tiny
from hf_paged.testing.hybrid_configs import HYBRID_FAMILIES
from hf_paged.testing.hybrid_oracle import NEW_TOKENS, hybrid_prompts, paged_batched, stock_alone

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs one CUDA device"),
]
BASE = dict(device="cuda", kv_block_size=16, max_model_len=96)
CRAMPED = dict(BASE, max_num_batched_tokens=16, num_kv_blocks=10)


@pytest.fixture(scope="module", params=HYBRID_FAMILIES)
def family(request):
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


def test_batched_greedy_equals_alone_with_decode_graphs(family):
    model, prompts, ref = family
    rows, fell = paged_batched(model, prompts, BASE)
    assert fell == []
    runner = _runner(model)
    assert runner.cuda_graph_reason is None and runner.graph_runner is not None
    assert runner.graph_runner.state_pool is runner.state_pool
    assert rows == ref
    release(model)


def test_cramped_engine_equals_alone(family):
    model, prompts, ref = family
    rows, fell = paged_batched(model, prompts, CRAMPED)
    assert fell == []
    from hf_paged.integration.engine_owner import existing_owner

    assert existing_owner(model).engine.stats["num_preemptions"] > 0
    assert rows == ref
    release(model)
