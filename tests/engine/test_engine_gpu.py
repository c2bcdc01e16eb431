"""The whole engine on one GPU: Triton backend + decode CUDA graphs against stock HF generate
(fp32 greedy parity) and against eager mode (graph replay = eager); on Hopper, programmatic
dependent launch (kernels/pdl.py) changes no token (fp32 parity, bf16 equal to PDL off)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import hf_greedy, save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 24


def _pdl_supported() -> bool:
    from hf_paged.kernels import pdl

    return pdl._supported(torch.cuda.current_device())


def prompts(n=20, seed=0):
    rng = random.Random(seed)
    lens = [1, 16, 17, 32, 33] + [rng.randint(2, 60) for _ in range(n - 5)]
    return [[rng.randrange(3, 256) for _ in range(k)] for k in lens]


@pytest.fixture(scope="module", params=["llama3_rope", "mistral", "qwen2", "qwen3"])
def model_path(request, tmp_path_factory):
    overrides = {"sliding_window": 12} if request.param == "mistral" else {}
    return save_tiny_model(request.param, str(tmp_path_factory.mktemp(request.param)), **overrides)


def hf_tokens(path, ps, dtype):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).cuda().eval()
    return hf_greedy(hf, ps, new_tokens=NEW)


def ours(path, ps, **kw):
    sp = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    cfg = dict(max_model_len=128, kv_block_size=16, num_kv_blocks=512, max_num_seqs=32)
    cfg.update(kw)
    with LLM(path, **cfg) as llm:
        assert llm.engine.executor.runner.attn_backend.name == "triton"
        assert (llm.engine._overlap is not None) == cfg.get("async_scheduling", True)
        graphs = llm.engine.executor.runner.graph_runner is not None
        return [o.token_ids for o in llm.generate(ps, sp, use_tqdm=False)], graphs


def test_fp32_greedy_parity_with_cuda_graphs(model_path):
    ps = prompts()
    got, graphs = ours(model_path, ps, dtype="float32")
    assert graphs
    assert got == hf_tokens(model_path, ps, torch.float32)


def test_fp32_parity_chunked_prefix_preempt(model_path):
    ps = [[7, 8, 9] * 10 + p for p in prompts(12, seed=1)]  # shared prefix -> cache hits
    got, _ = ours(model_path, ps, dtype="float32", max_num_batched_tokens=40, num_kv_blocks=24)
    assert got == hf_tokens(model_path, ps, torch.float32)


def test_graph_replay_equals_eager_bf16(model_path):
    ps = prompts(27, seed=2)  # 27 sequences: replays the 32 graph with 5 padding rows
    eager, _ = ours(model_path, ps, dtype="bfloat16", enforce_eager=True)
    graph, graphs = ours(model_path, ps, dtype="bfloat16")
    assert graphs
    same = sum(a == b for a, b in zip(eager, graph))
    assert same >= len(ps) - 1, f"only {same}/{len(ps)} sequences identical"


def test_fp32_parity_sync_scheduling(model_path):
    """Synchronous stepping on CUDA (the other tests run the default there: overlapped stepping,
    with pinned token copies, events and on-device input gathering)."""
    ps = prompts(12, seed=3)
    got, graphs = ours(model_path, ps, dtype="float32", async_scheduling=False)
    assert graphs
    assert got == hf_tokens(model_path, ps, torch.float32)


@pytest.mark.skipif(
    not _pdl_supported(), reason="PDL needs compute capability 9.0+ and a Triton with launch_pdl"
)
def test_engine_tokens_unchanged_with_pdl(tmp_path, monkeypatch):
    from hf_paged import envs

    path = save_tiny_model("qwen3", str(tmp_path / "qwen3"))
    ps = prompts(12, seed=5)
    monkeypatch.setattr(envs, "HF_PAGED_PDL", False)
    off_bf16, _ = ours(path, ps, dtype="bfloat16")
    monkeypatch.setattr(envs, "HF_PAGED_PDL", True)
    on_fp32, graphs = ours(path, ps, dtype="float32")
    assert graphs
    assert on_fp32 == hf_tokens(path, ps, torch.float32)
    on_bf16, _ = ours(path, ps, dtype="bfloat16")
    assert on_bf16 == off_bf16
