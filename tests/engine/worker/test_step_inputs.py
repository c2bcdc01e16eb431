"""ModelRunner step inputs: the int32 metadata layout (what Triton specializes on stays constant
from step to step) and the warm-up step, which goes through the served path (StepInputs.prefill,
the model, the LM head) and must give the model's real logits."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM
from hf_paged.engine.core.contracts import ModelInput, ScheduledChunk
from hf_paged.testing import save_tiny_model


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("qwen3"))
    save_tiny_model("qwen3", path, seed=0)
    return path


@pytest.fixture(scope="module")
def runner(model_path):
    with LLM(model_path, max_model_len=64, max_num_batched_tokens=160, kv_block_size=8) as llm:
        yield llm.engine.executor.runner


@pytest.mark.parametrize("table_lens", [[1], [3, 1], [5, 17, 2], [16, 16, 16, 16, 1], [9] * 7])
def test_metadata_layout_is_specialization_stable(runner, table_lens):
    chunks = [
        ScheduledChunk(i, [5] * (i + 1), n * 8 - (i + 1), list(range(100 * i, 100 * i + n)), True)
        for i, n in enumerate(table_lens)
    ]
    inp = ModelInput(chunks)
    cu = [0]
    for c in chunks:
        cu.append(cu[-1] + len(c.token_ids))
    ctx = [c.start_pos + len(c.token_ids) for c in chunks]
    meta = runner.inputs._metadata(inp, cu, ctx, torch.empty(0), False, runner.kv_cache)
    n, mb = len(chunks), max(table_lens)
    assert tuple(meta.block_tables.shape) == (n, mb)
    assert meta.block_tables.stride(0) % 16 == 0 and meta.block_tables.stride(1) == 1
    for t in (meta.block_tables, meta.context_lens, meta.cu_seqlens_q):
        assert (t.storage_offset() * t.element_size()) % 16 == 0  # 16-byte aligned segments
    for i, c in enumerate(chunks):
        row = meta.block_tables[i].tolist()
        assert row[: len(c.block_table)] == c.block_table and not any(row[len(c.block_table) :])
    assert meta.context_lens.tolist() == ctx and meta.cu_seqlens_q.tolist() == cu


def test_warmup_step_gives_the_models_logits(model_path):
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with LLM(model_path, max_model_len=64, max_num_batched_tokens=160, kv_block_size=8) as llm:
        runner = llm.engine.executor.runner
        served = runner.kv_cache
        try:
            ids, positions, meta, idx = runner._warmup_inputs()
            logits = runner._warmup_forward(ids, positions, meta, idx)
            assert meta.kv_cache is runner.kv_cache and meta.kv_cache is not served
            written = sum(meta.kv_cache[i][0].abs().sum().item() for i in range(len(served)))
        finally:
            runner.kv_cache = served
    # min(max_model_len, budget) = 64-token prompts of token 0, budget // 64 = 2 of them
    assert tuple(logits.shape) == (2, hf.config.vocab_size) and meta.num_seqs == 2
    assert written > 0  # the temporary cache was written, as in a served step
    with torch.no_grad():
        want = hf(torch.zeros(1, 64, dtype=torch.long)).logits[0, -1]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[1], want, rtol=1e-4, atol=1e-4)
