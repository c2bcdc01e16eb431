"""Greedy parity of the engine with stock HF ``generate`` on tiny fp32 models of each family,
under default budgets, KV pressure (preemption), chunked prefill and prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import hf_greedy, paged_greedy, save_tiny_model, spread_prompts
from hf_paged.testing.parity import MAX_MODEL_LEN, NEW_TOKENS

# (family, config overrides); tied and untied embeddings, GQA and MQA, rope scaling, window
VARIANTS = {
    "llama3_rope": ("llama3_rope", {"tie_word_embeddings": False}),
    "llama_linear_tied": ("llama", {"tie_word_embeddings": True,
                                    "rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 10000.0}}),
    "mistral_window": ("mistral", {"sliding_window": 12}),
    "qwen2_bias_mqa": ("qwen2", {"num_key_value_heads": 1}),
    "qwen2_sliding_layers": ("qwen2", {"use_sliding_window": True, "sliding_window": 10,
                                       "max_window_layers": 1}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    family, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_model(family, path, seed=0, **overrides)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def test_defaults(variant):
    path, hf = variant
    prompts = spread_prompts(16, 2, 40, seed=1)
    got, _ = paged_greedy(path, prompts)
    assert got == hf_greedy(hf, prompts)


def test_preemption(variant):
    path, hf = variant
    prompts = spread_prompts(16, 2, 40, seed=2)
    # 16 blocks of 8 = exactly max_model_len: far less than 16 sequences need at once
    got, stats = paged_greedy(path, prompts, num_kv_blocks=MAX_MODEL_LEN // 8)
    assert stats["num_preemptions"] > 0
    assert got == hf_greedy(hf, prompts)


def test_chunked_prefill(variant):
    path, hf = variant
    prompts = spread_prompts(16, 7, 40, seed=3)  # every prompt longer than the budget
    got, _ = paged_greedy(path, prompts, max_num_batched_tokens=6, max_num_seqs=6)
    assert got == hf_greedy(hf, prompts)


def test_prefix_caching(variant):
    path, hf = variant
    shared = [7 + (i * 13) % 240 for i in range(20)]
    prompts = spread_prompts(16, 1, 12, seed=5, prefix=shared)
    on, stats = paged_greedy(path, prompts, enable_prefix_caching=True, max_num_seqs=4)
    off, _ = paged_greedy(path, prompts, enable_prefix_caching=False, max_num_seqs=4)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert on == off == hf_greedy(hf, prompts)


@pytest.mark.parametrize("block_size", [4, 8])
def test_block_boundaries_and_repeated_prompts(variant, block_size):
    """Prompt lengths at block edges; identical prompts (whole-prompt cache hits, capped so at
    least one token is computed); a second pass over the same prompts hits the cache again."""
    path, hf = variant
    base = [3 + (i * 37) % 250 for i in range(4 * block_size + 1)]
    lengths = [1, block_size - 1, block_size, block_size + 1, 2 * block_size, 4 * block_size + 1]
    prompts = [base[:n] for n in lengths] * 2  # every prompt twice
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with LLM(path, max_model_len=MAX_MODEL_LEN, kv_block_size=block_size, num_kv_blocks=512,
             max_num_seqs=3) as llm:  # fmt: skip
        first = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        second = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm.stats["prefix_cache_hit_tokens"] > 0
    ref = hf_greedy(hf, prompts[: len(lengths)])
    assert first == second == ref + ref


# ---- on one GPU (marker ``gpu``; skipped without CUDA by tests/engine/conftest.py) ----
# The whole engine on one GPU: Triton backend + decode CUDA graphs against stock HF generate (fp32
# greedy parity) and against eager mode (graph replay = eager); on Hopper, programmatic dependent
# launch (kernels/pdl.py) changes no token (fp32 parity, bf16 equal to PDL off).


GPU_NEW = 24


def _pdl_supported() -> bool:
    from hf_paged.kernels import pdl

    return pdl._supported(torch.cuda.current_device())


def gpu_prompts(n=20, seed=0):
    rng = random.Random(seed)
    lens = [1, 16, 17, 32, 33] + [rng.randint(2, 60) for _ in range(n - 5)]
    return [[rng.randrange(3, 256) for _ in range(k)] for k in lens]


@pytest.fixture(scope="module", params=["llama3_rope", "mistral", "qwen2", "qwen3"])
def gpu_model_path(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else {}
    return save_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)), **overrides)


def gpu_hf_tokens(path, ps, dtype):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    return hf_greedy(hf, ps, new_tokens=GPU_NEW)


def gpu_ours(path, ps, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=GPU_NEW, min_tokens=GPU_NEW)
    cfg = dict(max_model_len=128, kv_block_size=16, num_kv_blocks=512, max_num_seqs=32)
    cfg.update(kw)
    with LLM(path, **cfg) as llm:
        assert llm.engine.executor.runner.attn_backend.name == "triton"
        assert (llm.engine.overlap is not None) == cfg.get("async_scheduling", True)
        graphs = llm.engine.executor.runner.graph_runner is not None
        return [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)], graphs


@pytest.mark.gpu
def test_fp32_greedy_parity_with_cuda_graphs(gpu_model_path):
    ps = gpu_prompts()
    got, graphs = gpu_ours(gpu_model_path, ps, dtype="float32")
    assert graphs
    assert got == gpu_hf_tokens(gpu_model_path, ps, torch.float32)


@pytest.mark.gpu
def test_fp32_parity_chunked_prefix_preempt(gpu_model_path):
    ps = [[7, 8, 9] * 10 + p for p in gpu_prompts(12, seed=1)]  # shared prefix -> cache hits
    got, _ = gpu_ours(
        gpu_model_path, ps, dtype="float32", max_num_batched_tokens=40, num_kv_blocks=24
    )
    assert got == gpu_hf_tokens(gpu_model_path, ps, torch.float32)


@pytest.mark.gpu
def test_graph_replay_equals_eager_bf16(gpu_model_path):
    ps = gpu_prompts(27, seed=2)  # 27 sequences: replays the 32 graph with 5 padding rows
    eager, _ = gpu_ours(gpu_model_path, ps, dtype="bfloat16", enforce_eager=True)
    graph, graphs = gpu_ours(gpu_model_path, ps, dtype="bfloat16")
    assert graphs
    same = sum(a == b for a, b in zip(eager, graph))
    assert same >= len(ps) - 1, f"only {same}/{len(ps)} sequences identical"


@pytest.mark.gpu
def test_fp32_parity_sync_scheduling(gpu_model_path):
    """Synchronous stepping on CUDA (the other tests run the default there: overlapped stepping,
    with pinned token copies, events and on-device input gathering)."""
    ps = gpu_prompts(12, seed=3)
    got, graphs = gpu_ours(gpu_model_path, ps, dtype="float32", async_scheduling=False)
    assert graphs
    assert got == gpu_hf_tokens(gpu_model_path, ps, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or not _pdl_supported(),
    reason="PDL needs compute capability 9.0+ and a Triton with launch_pdl",
)
def test_engine_tokens_unchanged_with_pdl(tmp_path, monkeypatch):
    from hf_paged import envs

    path = save_tiny_model("qwen3", str(tmp_path / "qwen3"))
    ps = gpu_prompts(12, seed=5)
    monkeypatch.setattr(envs, "HF_PAGED_PDL", False)
    off_bf16, _ = gpu_ours(path, ps, dtype="bfloat16")
    monkeypatch.setattr(envs, "HF_PAGED_PDL", True)
    on_fp32, graphs = gpu_ours(path, ps, dtype="float32")
    assert graphs
    assert on_fp32 == gpu_hf_tokens(path, ps, torch.float32)
    on_bf16, _ = gpu_ours(path, ps, dtype="bfloat16")
    assert on_bf16 == off_bf16
