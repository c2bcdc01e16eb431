"""The model protocol: a toy PagedModel that is not Llama (two layers with different KV specs)
runs through the engine by registering it, with no engine change; the KV cache is sized and laid
out from ``kv_cache_specs``; model selection by ``model_impl``; layering."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from hf_paged import LLM, EngineConfig, SamplingParams
from hf_paged.attention.kv_cache import KVCache, KVCacheSpec
from hf_paged.models import registry
from hf_paged.models.protocol import PagedModel
from hf_paged.testing import save_tiny_model, tiny_config, toy_model

NEW_TOKENS = 12


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy")
    model = toy_model.save_toy_model(path)
    return str(path), model


@pytest.fixture
def registered(monkeypatch):
    entry = ("hf_paged.testing.toy_model", "ToyPagedForCausalLM")
    monkeypatch.setitem(registry.NATIVE_ARCHITECTURES, toy_model.ARCH, entry)


def dense_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.dense_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize(
    "engine",
    [
        {"max_num_seqs": 2},  # later prompts hit the prefix cache
        {"max_num_batched_tokens": 5, "max_num_seqs": 3},  # chunked prefill, mixed steps
        {"num_kv_blocks": 12, "max_num_seqs": 6},  # preemption
    ],
)
def test_toy_paged_model_runs_through_the_engine(toy, registered, engine):
    path, model = toy
    shared = [5, 17, 33, 2, 60, 8, 41, 9, 12]  # a prefix-cache hit for later prompts
    prompts = [[3], shared + [7, 1], shared + [70], [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]]
    prompts += [shared + [i] for i in range(20, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    cfg = {"max_model_len": 32, "kv_block_size": 4, "num_kv_blocks": 64, **engine}
    with LLM(path, **cfg) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.engine.executor.runner
        stats = dict(llm.stats)
        assert isinstance(runner.model, toy_model.ToyPagedForCausalLM)
        assert isinstance(runner.model, PagedModel)
        kv = runner.kv_cache
        assert [tuple(kv[i][0].shape[2:]) for i in range(2)] == [(2, 16), (1, 32)]
        assert [tuple(kv[i][1].shape[2:]) for i in range(2)] == [(2, 16), (1, 24)]
        assert kv.num_blocks == stats["num_kv_blocks"] == cfg["num_kv_blocks"]
    want = [dense_greedy(model, p, NEW_TOKENS) for p in prompts]
    assert [o.token_ids for o in outs] == want
    assert len({tuple(w) for w in want}) > 2  # the outputs differ: the test can see mistakes
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    if "num_kv_blocks" in engine:
        assert stats["num_preemptions"] > 0
    else:
        assert stats["prefix_cache_hit_tokens"] > 0


def test_kv_cache_is_sized_from_the_specs(toy, registered):
    path, _ = toy
    # block bytes: layer 0: 4 tok * 2 heads * (16 + 16) * 4 B; layer 1: 4 * 1 * (32 + 24) * 4
    block_bytes = 4 * 2 * 32 * 4 + 4 * 1 * 56 * 4
    with LLM(path, max_model_len=32, kv_block_size=4, kv_cache_bytes=block_bytes * 20) as llm:
        runner = llm.engine.executor.runner
        assert runner.kv_block_bytes() == block_bytes
        assert runner.kv_cache.num_blocks == 20 and runner.kv_cache.nbytes() == 20 * block_bytes


def test_uniform_model_keeps_one_kv_tensor(tmp_path):
    """A Llama's layers share one spec: one [2, L, blocks, block, Hkv, D] tensor, as the Triton
    kernels and CUDA graphs were tuned for."""
    save_tiny_model("llama", tmp_path)
    with LLM(str(tmp_path), max_model_len=32, kv_block_size=8, num_kv_blocks=10) as llm:
        runner = llm.engine.executor.runner
        kv, cfg = runner.kv_cache, runner.spec.hf_config
        (storage,) = kv.storage
        hd = cfg.hidden_size // cfg.num_attention_heads
        shape = (2, cfg.num_hidden_layers, 10, 8, cfg.num_key_value_heads, hd)
        assert tuple(storage.shape) == shape
        for i in range(len(kv)):
            k, v = kv[i]
            assert k.data_ptr() == storage[0, i].data_ptr() and v.is_contiguous()
            assert k.stride() == v.stride() == storage[0, 0].stride()
        assert not any(hasattr(m, "k_cache") for m in runner.model.modules())


def test_kv_cache_groups_equal_specs_and_releases():
    a, b = KVCacheSpec(2, 16, 16), KVCacheSpec(1, 32, 24)
    kv = KVCache([a, b, a, b], num_blocks=3, block_size=4, dtype=torch.float32, device="cpu")
    assert len(kv) == 4 and len(kv.storage) == 3  # a: one K+V tensor; b: K and V apart
    assert kv[0][0].data_ptr() != kv[2][0].data_ptr()
    assert kv[0][0].untyped_storage().data_ptr() == kv[2][0].untyped_storage().data_ptr()
    assert tuple(kv[3][1].shape) == (3, 4, 1, 24) and kv[3][1].is_contiguous()
    assert KVCache.block_bytes([a, b], 4, torch.bfloat16) == 4 * 2 * (2 * 32 + 56)
    kv[1][0].fill_(1.0)
    assert kv[3][0].abs().sum() == 0  # layers never alias
    kv.release()
    with pytest.raises(RuntimeError, match="released"):
        kv[0]
    empty = KVCache([], 3, 4, torch.float32, "cpu")  # recurrent layers alone: bookkeeping
    assert len(empty) == 0 and empty.nbytes() == 0
    empty.copy_blocks([(0, 1)])  # nothing to copy
    with pytest.raises(ValueError, match="head_dim_v=0"):
        KVCacheSpec(1, 16, 0)


def test_model_impl_is_validated_and_named():
    with pytest.raises(ValueError, match="model_impl='fast' is not allowed.*'auto', 'native'"):
        EngineConfig(model_impl="fast")
    llama = tiny_config("llama")
    assert registry.resolve_model_class(llama, "native").__name__ == "LlamaForCausalLM"
    assert registry.resolve_model_class(llama, "auto").__name__ == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="model_impl='bogus' is not allowed"):
        registry.resolve_model_class(llama, "bogus")
    other = tiny_config("llama")
    other.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' is not supported.*LlamaForCausalLM"):
        registry.resolve_model_class(other, "native")


def test_generic_path_missing_raises_value_error_naming_model_impl(monkeypatch):
    monkeypatch.setattr(registry, "GENERIC", ("hf_paged.models.no_such_module", "Generic"))
    other = tiny_config("llama")
    other.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="model_impl='generic' is not available"):
        registry.resolve_model_class(tiny_config("llama"), "generic")
    with pytest.raises(ValueError, match="'GPT2LMHeadModel' has no native.*model_impl='auto'"):
        registry.resolve_model_class(other, "auto")
    assert not registry.is_supported(other)


def test_registered_class_is_loaded_lazily(registered):
    config = tiny_config("llama")
    config.architectures = [toy_model.ARCH]
    assert registry.resolve_model_class(config) is toy_model.ToyPagedForCausalLM


def test_layers_import_nothing_from_models():
    root = Path(__file__).resolve().parents[2] / "hf_paged" / "layers"
    for file in root.glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            assert not any(n.startswith("hf_paged.models") for n in names), (file.name, names)


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# The model protocol on one GPU: a toy PagedModel with uneven per-layer KV specs through the
# engine (Triton kernels on slices of the runner's KVCache, decode CUDA graphs when every layer is
# within the kernels' reach, eager decode with a named reason when a layer needs the torch
# reference); the uniform Llama cache stays one tensor.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


NEW = 16
PROMPTS = [[3], [5, 17, 33, 2, 60, 8, 41, 9, 12, 7], list(range(10, 40)), [70, 71] * 9]


@pytest.fixture(autouse=True)
def cuda_registered(monkeypatch):
    entry = ("hf_paged.testing.toy_model", "ToyPagedForCausalLM")
    monkeypatch.setitem(registry.NATIVE_ARCHITECTURES, toy_model.ARCH, entry)


def cuda_dense_greedy(model, prompt):
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


@pytest.mark.gpu
@needs_cuda
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
    assert got == [cuda_dense_greedy(ref, p) for p in PROMPTS]


@pytest.mark.gpu
@needs_cuda
def test_toy_graph_replay_equals_eager(tmp_path):
    toy_model.save_toy_model(tmp_path, layers=toy_model.TRITON_LAYERS)
    eager, graphs_eager, reason, _, _ = run(str(tmp_path), enforce_eager=True)
    graph, graphs, _, _, _ = run(str(tmp_path))
    assert not graphs_eager and reason == "enforce_eager=True" and graphs
    assert graph == eager


@pytest.mark.gpu
@needs_cuda
def test_llama_kv_cache_is_one_tensor_on_gpu(tmp_path):
    path = save_tiny_model("qwen3", str(tmp_path))
    with LLM(path, max_model_len=64, kv_block_size=16, num_kv_blocks=32) as llm:
        runner = llm.engine.executor.runner
        (storage,) = runner.kv_cache.storage
        assert storage.shape[:4] == (2, runner.spec.hf_config.num_hidden_layers, 32, 16)
        assert runner.graph_runner is not None
