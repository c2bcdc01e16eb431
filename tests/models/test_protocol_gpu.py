"""The model protocol on one GPU: a toy PagedModel with uneven per-layer KV specs through the
engine (Triton kernels on slices of the runner's KVCache, decode CUDA graphs when every layer is
within the kernels' reach, eager decode with a named reason when a layer needs the torch
reference); the uniform Llama cache stays one tensor."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.models import registry
from hf_paged.testing import save_tiny_model, toy_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 16
PROMPTS = [[3], [5, 17, 33, 2, 60, 8, 41, 9, 12, 7], list(range(10, 40)), [70, 71] * 9]


@pytest.fixture(autouse=True)
def registered(monkeypatch):
    entry = ("hf_paged.testing.toy_model", "ToyPagedForCausalLM")
    monkeypatch.setitem(registry.NATIVE_ARCHITECTURES, toy_model.ARCH, entry)


def dense_greedy(model, prompt):
    ids = list(prompt)
    for _ in range(NEW):
        ids.append(int(model.dense_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


def run(path, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    cfg = dict(max_model_len=64, kv_block_size=16, num_kv_blocks=64, dtype="float32", **kw)
    with LLM(path, **cfg) as llm:
        runner = llm.engine.executor.runner
        out = [o.token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)]
        # read before close() releases the cache and the graphs
        kv_dims = [[t.shape[-1] for t in runner.kv_cache[i]] for i in range(len(runner.kv_cache))]
        return out, runner.graph_runner is not None, runner.cuda_graph_reason, runner, kv_dims


@pytest.mark.parametrize("layers", ["triton", "modifiers", "mixed"])
def test_toy_model_greedy_matches_dense_oracle(layers, tmp_path):
    table = {"triton": toy_model.TRITON_LAYERS, "modifiers": toy_model.LAYERS,
             "mixed": toy_model.FALLBACK_LAYERS}[layers]  # fmt: skip
    ref = toy_model.save_toy_model(tmp_path, layers=table)
    got, graphs, reason, runner, kv_dims = run(str(tmp_path))
    assert runner.attn_backend.name == "triton"
    assert kv_dims[1] == [table[1][2], table[1][3]]
    if layers != "mixed":  # softcap and V head dim != K's run in the kernels, graphs included
        assert graphs and reason is None
    else:
        assert not graphs and "layers [1] use the torch reference" in reason
    assert got == [dense_greedy(ref, p) for p in PROMPTS]


def test_toy_graph_replay_equals_eager(tmp_path):
    toy_model.save_toy_model(tmp_path, layers=toy_model.TRITON_LAYERS)
    eager, graphs_eager, reason, _, _ = run(str(tmp_path), enforce_eager=True)
    graph, graphs, _, _, _ = run(str(tmp_path))
    assert not graphs_eager and reason == "enforce_eager=True" and graphs
    assert graph == eager


def test_llama_kv_cache_is_one_tensor_on_gpu(tmp_path):
    path = save_tiny_model("qwen3", str(tmp_path))
    with LLM(path, max_model_len=64, kv_block_size=16, num_kv_blocks=32) as llm:
        runner = llm.engine.executor.runner
        (storage,) = runner.kv_cache.storage
        assert storage.shape[:4] == (2, runner.spec.hf_config.num_hidden_layers, 32, 16)
        assert runner.graph_runner is not None
