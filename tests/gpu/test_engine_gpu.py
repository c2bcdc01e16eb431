"""The whole engine on one GPU: Triton backend + decode CUDA graphs against stock HF generate
(fp32 greedy parity) and against eager mode (graph replay = eager)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 24


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
    out = []
    for p in ps:
        ids = torch.tensor([p], device="cuda")
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(seq[0, len(p) :].tolist())
    return out


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
