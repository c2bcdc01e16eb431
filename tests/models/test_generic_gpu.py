"""The generic model path on one GPU: fp32 greedy parity with stock for every architecture the
CPU coverage test serves (Triton backend, decode CUDA graphs where the probe allows them), the
CUDA-graph probe itself, and model_impl="generic" against native."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing import build_tiny, hf_greedy, save_tiny_model
from tests.models.coverage_models import markdown_table, run_all, summary

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def test_coverage_cuda_parity():
    """Every served architecture gives stock's tokens on CUDA too; none fails."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_all(device="cuda")
    print("\n" + markdown_table(results))
    failed = [(r.model_type, r.detail) for r in results if r.status == "failure"]
    assert failed == []
    assert summary(results)["served"] > 0


def _engine(model, **kw):
    return LLM(model, max_model_len=128, kv_block_size=16, num_kv_blocks=64, **kw)


def test_graph_probe_llama_captures(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"))
    with _engine(path, model_impl="generic") as llm:
        runner = llm.engine.executor.runner
        assert runner.model.supports_cuda_graph, runner.model.cuda_graph_reason
        assert runner.graph_runner is not None


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gemma2", "gpt_oss"])
def test_graph_probe_decides_and_tokens_match(model_type):
    """Whatever the probe decides (MoE expert loops sync with the host), tokens equal stock's,
    with and without enforce_eager; the reason is kept when graphs are off."""
    _, hf = build_tiny(model_type)
    hf = hf.cuda()
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = []
    for eager in (False, True):
        with _engine(hf, enforce_eager=eager) as llm:
            model = llm.engine.executor.runner.model
            if not model.supports_cuda_graph:
                assert model.cuda_graph_reason
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] == hf_greedy(hf, prompts, new_tokens=24)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generic_equals_native_cuda(family, tmp_path):
    path = save_tiny_model(family, str(tmp_path / family))
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = {}
    for impl in ("native", "generic"):
        with _engine(path, model_impl=impl) as llm:
            got[impl] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["generic"] == got["native"]
