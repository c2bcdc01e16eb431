"""Mixed precision as accelerate sets it (``models/autocast.py``): a forward wrapped in
``torch.autocast("cpu", bf16)`` over float32 weights is served paged, the engine computing under
the same autocast. The oracle is stock under the same wrapper, each prompt alone: stock is itself
batch-variant under bf16 (a left-padded batch moves some rows off their tokens alone), so tokens
are compared on the rows where stock's own batch equals stock alone, and scores are held to
stock's alone both ways: close at bf16's resolution, and clearly farther from the float32 scores
(so a test on an engine that ignored the autocast fails). Other autocasts fall back by name.

Whole prompts are prefilled (no chunk, no prefix hit): that is where the engine reproduces stock
alone exactly; a chunked or prefix-cached prefill moves scores by bf16 rounding steps, as stock's
own padding does."""

from __future__ import annotations

import logging
import types
import warnings

import pytest
import torch

from hf_paged import PagedFallbackWarning
from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.integration.fallback import reset_fallback_warnings
from hf_paged.models.autocast import AutocastState, autocast_refusal
from hf_paged.models.forward_wrappers import instance_autocast, instance_forward_refusal
from hf_paged.testing import build_hf_model
from hf_paged.testing.any_model import build_tiny
from hf_paged.testing.prompts import left_pad, make_prompts

pytest.importorskip("accelerate")

NEW_TOKENS = 24
LENGTHS = [1, 2, 5, 8, 16, 17, 31, 40]  # length 1, around KV blocks of 4
# whole prompts in one step, every sequence at once: no chunked prefill, no waiting
ENGINE = dict(num_kv_blocks=256, kv_block_size=4, max_num_seqs=8, max_num_batched_tokens=512,
              seed=0)  # fmt: skip
BF16 = AutocastState("cpu", torch.bfloat16)


@pytest.fixture(autouse=True)
def _dispatch(one_thread, clean_dispatch):
    """The dispatcher installed and fallback warnings forgotten (tests/conftest.py)."""


def accelerate_mixed_precision(model, dtype=torch.bfloat16, device="cpu", module=None) -> None:
    """What ``Accelerator.prepare_model`` does with mixed precision on (on ``module``'s forward
    when given, else the model's)."""
    from accelerate.utils import convert_outputs_to_fp32

    target = module if module is not None else model
    autocast = torch.autocast(device, dtype=dtype)
    target.forward = types.MethodType(autocast(target.forward.__func__), target)
    target.forward = types.MethodType(convert_outputs_to_fp32(target.forward.__func__), target)


def _model(family: str):
    if family == "gemma2":  # the generic path: HF's own modules, paged attention
        return build_tiny("gemma2")[1]
    return build_hf_model(family, seed=0)


def _kwargs(**more) -> dict:
    return dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                pad_token_id=0, output_scores=True, return_dict_in_generate=True, **more)  # fmt: skip


def _stock_alone(model, prompts):
    """Each prompt alone through stock: (new tokens, scores [T, V]) per prompt."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **_kwargs(backend="hf"))
        outs.append((out.sequences[0, len(p) :].tolist(), torch.cat(out.scores)))
    return outs


def _batched(model, prompts, backend: str):
    ids, mask = left_pad(prompts)
    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PagedFallbackWarning)
        out = model.generate(ids, attention_mask=mask, **_kwargs(backend=backend))
    msgs = [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
    rows = out.sequences[:, ids.shape[1] :].tolist()
    scores = torch.stack(out.scores, dim=1)  # [B, T, V]
    return rows, scores, msgs


def _finite_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| where both are finite (min_new_tokens puts -inf on EOS in both)."""
    both = torch.isfinite(a) & torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    return (a - b)[both].abs()


# native (Qwen3: q/k norms; Mistral: a sliding window on every layer) and the generic path
@pytest.mark.parametrize("family", ["llama", "qwen3", "mistral", "gemma2"])
def test_bf16_autocast_is_served_and_computes_as_stock_under_it(family, caplog):
    model = _model(family)
    prompts = make_prompts(LENGTHS, seed=0, vocab=model.config.vocab_size)
    dispatch.configure(model, **ENGINE)
    fp32_alone = _stock_alone(model, prompts)
    fp32_rows, _, msgs = _batched(model, prompts, "paged")  # an engine without autocast first
    assert msgs == [] and fp32_rows == [t for t, _ in fp32_alone]

    accelerate_mixed_precision(model)
    assert instance_forward_refusal(model) is None and instance_autocast(model) == BF16
    alone = _stock_alone(model, prompts)
    stock_rows, _, _ = _batched(model, prompts, "hf")
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        rows, scores, msgs = _batched(model, prompts, "paged")
    assert msgs == []
    assert "mixed precision changed: none -> torch.autocast('cpu', dtype=torch.bfloat16)" in (
        caplog.text
    )  # the engine built without autocast was rebuilt under it
    assert existing_owner(model).builds == 2

    invariant = [i for i, (t, _) in enumerate(alone) if stock_rows[i] == t]
    assert len(invariant) >= len(prompts) // 2, "stock's own batch moved most rows"
    for i in invariant:
        assert rows[i] == alone[i][0], f"row {i} (prompt of {len(prompts[i])} tokens)"
    # scores: the first step's (same inputs whatever the tokens), and every step of equal rows
    step0 = torch.stack([s[0] for _, s in alone])  # [B, V]
    fp32_step0 = torch.stack([s[0] for _, s in fp32_alone])
    paged_diff = _finite_diff(scores[:, 0], step0)
    fp32_diff = _finite_diff(fp32_step0, step0)
    assert paged_diff.max() <= 0.125  # a bf16 rounding step or two at these logits
    assert (paged_diff == 0).float().mean() >= 0.9
    assert (fp32_diff == 0).float().mean() <= 0.1  # float32 is far: autocast made a difference
    assert paged_diff.mean() * 8 <= fp32_diff.mean()
    for i in invariant:
        assert _finite_diff(scores[i], alone[i][1]).max() <= 0.125


def test_the_native_path_serves_the_llama_family_under_autocast():
    """The fused qkv / gate_up projections compute each output row as stock's separate ones do
    under autocast (bf16 GEMMs over the same weight rows): the native path is kept."""
    model = build_hf_model("llama", seed=0)
    accelerate_mixed_precision(model)
    engine = dispatch.get_engine(model, ENGINE)
    assert engine.runtime.autocast == BF16
    assert engine.executor.runner.autocast == BF16
    assert not hasattr(engine.executor.runner.model, "hf_model")  # native, not generic


@pytest.mark.parametrize(
    "case, why",
    [
        ("fp16", "bf16 autocast only"),
        ("bf16_weights", "over float32 weights"),
        ("submodule", "not one module apart"),
    ],
)
def test_autocasts_the_engine_does_not_reproduce_fall_back_by_name(case, why):
    model = build_hf_model("llama", seed=0)
    if case == "fp16":
        accelerate_mixed_precision(model, dtype=torch.float16)
    elif case == "bf16_weights":
        model = model.to(torch.bfloat16)
        accelerate_mixed_precision(model)
    else:
        accelerate_mixed_precision(model, module=model.model)
    assert instance_autocast(model) is None
    if case == "submodule":
        refusal = instance_forward_refusal(model.model, "model")
    else:
        refusal = instance_forward_refusal(model)
    assert refusal.reason == "autocast" and why in refusal.detail
    assert "mixed precision off" in refusal.detail or "mixed_precision='no'" in refusal.detail
    prompts = make_prompts([3, 7], seed=1)
    dispatch.configure(model, **ENGINE)
    paged, paged_scores, msgs = _batched(model, prompts, "paged")
    stock, stock_scores, _ = _batched(model, prompts, "hf")
    assert len(msgs) == 1 and "[autocast]" in msgs[0] and why in msgs[0]
    assert paged == stock and torch.equal(paged_scores, stock_scores)  # it ran stock


@pytest.mark.parametrize("model_type, why", [("mamba", "recurrent layers (MambaMixer)"),
                                             ("jamba", "recurrent layers")])  # fmt: skip
def test_bf16_autocast_on_recurrent_layers_falls_back_by_name(model_type, why):
    """The engine's own mixers and float32 state pools do not follow autocast: refused."""
    model = build_tiny(model_type)[1]
    accelerate_mixed_precision(model)
    refusal = instance_forward_refusal(model)
    assert refusal.reason == "autocast" and why in refusal.detail
    assert instance_autocast(model) is None


def test_bf16_autocast_on_a_vision_language_model_falls_back_by_name():
    """Its image tower runs in the front end, outside the decoder's forward and its autocast."""
    from hf_paged.testing.vlm import build_tiny_vlm

    model = build_tiny_vlm("qwen3_vl")
    refusal = autocast_refusal(BF16, model)
    assert refusal.reason == "autocast" and "vision-language" in refusal.detail


def test_bf16_autocast_over_peft_adapters_falls_back_by_name():
    """Adapters merged or in LoRA slots are not PEFT's own bf16 matmuls: refused on the model
    whose forward is wrapped (accelerate wrapping a ``PeftModel`` leaves generation in fp32,
    tests/integration/test_trl_grpo.py)."""
    peft = pytest.importorskip("peft")
    model = build_hf_model("llama", seed=0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))
    inner = model.get_base_model()
    accelerate_mixed_precision(inner)
    refusal = instance_forward_refusal(inner)
    assert refusal.reason == "autocast" and "PEFT adapters" in refusal.detail


def test_an_autocast_for_another_device_is_refused():
    model = build_hf_model("llama", seed=0)
    refusal = autocast_refusal(AutocastState("cuda", torch.bfloat16), model)
    assert refusal.reason == "autocast" and "another device" in refusal.detail


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bf16_autocast_on_cuda_falls_back_by_name():
    """The fused Triton kernels (norm, rope with the KV write, paged attention) do not follow
    autocast's casts: on CUDA the wrapper runs stock, named."""
    model = build_hf_model("llama", seed=0).cuda()
    accelerate_mixed_precision(model, device="cuda")
    refusal = instance_forward_refusal(model)
    assert refusal.reason == "autocast" and "on CUDA" in refusal.detail
    ids = torch.tensor([[5, 9, 17, 33]], device="cuda")
    reset_fallback_warnings()
    with pytest.warns(PagedFallbackWarning, match=r"\[autocast\]"):
        paged = model.generate(ids, attention_mask=torch.ones_like(ids), **_kwargs(backend="paged"))
    stock = model.generate(ids, attention_mask=torch.ones_like(ids), **_kwargs(backend="hf"))
    assert torch.equal(paged.sequences, stock.sequences)
