"""Tiny FP8 checkpoints served with activations quantized as on the GPU, against the W8A8
reference, on CPU: ``HF_PAGED_FP8_GEMM=w8a8_ref`` makes every FP8 layer compute the package's
W8A8 reference (``w8a8_reference.w8a8_linear_ref``: the activation quantized exactly as the GPU
paths quantize it, fp32 math), and the oracle is a stock transformers model holding the
dequantized weights with every linear's input fake-quantized the same way
(``fake_quant_activations``). Both checkpoint kinds go through the real safetensors path:
fine-grained (transformers' quantizer, 32 x 32 blocks: activations per token and 32-column
group) and compressed-tensors (per channel with dynamic per-token activations; per tensor with a
static input scale). Greedy tokens are equal and prompt logprobs agree to 1e-4.

The GPU paths' agreement with the same reference: tests/kernels/test_fp8.py."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

from hf_paged import LLM, SamplingParams, envs
from hf_paged.layers.quantization.fp8_checkpoints import (
    load_finegrained_fp8,
    save_compressed_tensors_fp8,
)
from hf_paged.layers.quantization.w8a8_reference import fake_quant_activations
from hf_paged.testing import save_tiny_model

TOL = 1e-4
ENGINE = dict(max_model_len=96, kv_block_size=8, num_kv_blocks=64)
STATIC_SCALE = 0.05  # every static input scale (fused q/k/v and gate/up take the largest)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(3, 256, (9,), generator=g).tolist()  # a shared prefix
    return [[7]] + [
        shared + torch.randint(3, 256, (3 + 4 * i,), generator=g).tolist() for i in range(n)
    ]


def hf_scores(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    return seq[0, len(prompt) :].tolist()


@pytest.fixture(autouse=True)
def w8a8_path(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FP8_GEMM", "w8a8_ref")
    envs.reset("HF_PAGED_FP8_GEMM")
    yield
    monkeypatch.delenv("HF_PAGED_FP8_GEMM")
    envs.reset("HF_PAGED_FP8_GEMM")


def _check(path: str, ref, model_impl: str = "native") -> None:
    ps = prompts(4, seed=1)
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    with LLM(path, model_impl=model_impl, **ENGINE) as llm:
        scores = llm.generate(ps, scored, use_tqdm=False)
        outs = llm.generate(ps, greedy, use_tqdm=False)
    for p, s, o in zip(ps, scores, outs):
        lp = hf_scores(ref, p)
        for i in range(1, len(p)):
            want = lp[i - 1, p[i]].item()
            assert abs(s.prompt_logprobs[i].logprob - want) < TOL * max(1.0, abs(want)), (p, i)
        assert o.token_ids == hf_greedy(ref, p, 12)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("w8a8_plain")), seed=5)


@pytest.mark.parametrize("model_impl", ["native", "generic"])
def test_finegrained_checkpoint_matches_w8a8_reference(plain, tmp_path, model_impl):
    load_finegrained_fp8(plain, (32, 32), dtype=torch.float32).save_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(
        tmp_path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()
    assert fake_quant_activations(ref, 32) == 7 * ref.config.num_hidden_layers
    _check(str(tmp_path), ref, model_impl)


@pytest.mark.parametrize(
    "strategy,dynamic", [("channel", True), ("tensor", False)], ids=["fp8_dynamic", "fp8_static"]
)
def test_compressed_tensors_checkpoint_matches_w8a8_reference(plain, tmp_path, strategy, dynamic):
    base = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32).eval()
    names = [n for n, m in base.named_modules() if isinstance(m, torch.nn.Linear)]
    scales = {n: STATIC_SCALE for n in names}
    dequantized = save_compressed_tensors_fp8(base, tmp_path, strategy, dynamic,
                                              input_scales=scales)  # fmt: skip
    with torch.no_grad():
        for name, w in dequantized.items():
            base.get_parameter(name).copy_(w)
    hooked = fake_quant_activations(base, None, None if dynamic else scales)
    assert hooked == 7 * base.config.num_hidden_layers
    _check(str(tmp_path), base)


def test_w8a8_reference_differs_from_the_weight_only_model(plain, tmp_path):
    """The oracle is not vacuous: activation quantization moves the logprobs by far more than
    the tolerance above (so the engine cannot pass by running the weight-only path)."""
    load_finegrained_fp8(plain, (32, 32), dtype=torch.float32).save_pretrained(tmp_path)
    kw = dict(quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    w8a16 = AutoModelForCausalLM.from_pretrained(tmp_path, **kw).eval()
    w8a8 = AutoModelForCausalLM.from_pretrained(tmp_path, **kw).eval()
    fake_quant_activations(w8a8, 32)
    p = prompts(1, seed=1)[1]
    assert (hf_scores(w8a16, p) - hf_scores(w8a8, p)).abs().max().item() > 100 * TOL
