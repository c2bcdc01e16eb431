"""Forwards set on the model instance by trainers: TRL's ``add_fused_lm_head`` (and
accelerate's fp32 output cast around it) is served paged and equals stock; so is accelerate's
bf16 autocast around them, the engine under the same autocast (tests/models/test_autocast.py:
its numerics and the autocasts that fall back); a wrapper that changes outputs falls back as
``patched_forward``, also when TRL's wrapper sits around it."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from hf_paged import PagedFallbackWarning
from hf_paged.integration import dispatch
from hf_paged.integration.fallback import reset_fallback_warnings
from hf_paged.models.autocast import AutocastState
from hf_paged.models.forward_wrappers import instance_autocast, instance_forward_refusal
from hf_paged.testing import SMALL_ENGINE, build_hf_model

trl_utils = pytest.importorskip("trl.trainer.utils")

IDS = torch.tensor([[0, 5, 9, 17, 33], [3, 4, 5, 6, 7]])
KWARGS = dict(input_ids=IDS, attention_mask=(IDS != 0).long(), max_new_tokens=8,
              do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)  # fmt: skip


@pytest.fixture(autouse=True)
def _dispatch(one_thread, clean_dispatch):
    """The dispatcher installed and fallback warnings forgotten (tests/conftest.py)."""


def _accelerate_mixed_precision(model, enabled: bool = True) -> None:
    """What ``Accelerator.prepare_model`` does with mixed_precision="bf16" on the CPU."""
    from accelerate.utils import convert_outputs_to_fp32

    model._original_forward = model.forward
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=enabled)
    model.forward = types.MethodType(autocast(model.forward.__func__), model)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def _paged_and_stock(model):
    dispatch.configure(model, **SMALL_ENGINE)
    reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", PagedFallbackWarning)
        paged = model.generate(**KWARGS, backend="paged")
    dispatch.release(model)
    stock = model.generate(**KWARGS, backend="hf")
    msgs = [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
    return paged, stock, msgs


def _assert_equal(paged, stock) -> None:
    assert torch.equal(paged.sequences, stock.sequences)
    for p, s in zip(paged.scores, stock.scores, strict=True):
        torch.testing.assert_close(p, s, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mixed_precision", ["off", "autocast_disabled"])
def test_trl_fused_lm_head_is_served_paged(mixed_precision):
    model = build_hf_model("llama", seed=0)
    trl_utils.add_fused_lm_head(model)
    if mixed_precision == "autocast_disabled":
        _accelerate_mixed_precision(model, enabled=False)
    assert instance_forward_refusal(model) is None
    paged, stock, msgs = _paged_and_stock(model)
    assert msgs == []
    _assert_equal(paged, stock)
    out = model(input_ids=IDS, labels=IDS, fused_lm_head=True)  # TRL's loss path still works
    assert out.log_probs.shape == (IDS.shape[0], IDS.shape[1] - 1)  # shifted labels


def test_trl_fused_lm_head_under_bf16_autocast_is_served_paged():
    """GRPO's model at TRL's defaults: TRL's wrapper inside accelerate's bf16 autocast and fp32
    output cast. Served, the engine under the same autocast (tests/models/test_autocast.py holds
    it to stock); each row equals stock's for that row alone."""
    model = build_hf_model("llama", seed=0)
    trl_utils.add_fused_lm_head(model)
    _accelerate_mixed_precision(model)
    assert instance_forward_refusal(model) is None
    assert instance_autocast(model) == AutocastState("cpu", torch.bfloat16)
    paged, _, msgs = _paged_and_stock(model)
    assert msgs == []
    for row in range(IDS.shape[0]):
        ids = IDS[row : row + 1, (IDS[row] != 0).nonzero()[0, 0] :]  # the row without padding
        alone = model.generate(**{**KWARGS, "input_ids": ids,
                                  "attention_mask": torch.ones_like(ids)}, backend="hf")  # fmt: skip
        new = paged.sequences[row, IDS.shape[1] :]
        assert torch.equal(new, alone.sequences[0, ids.shape[1] :])


@pytest.mark.parametrize("trl_outside", [False, True])
def test_a_wrapper_that_changes_outputs_falls_back(trl_outside):
    model = build_hf_model("llama", seed=0)
    inner = model.forward

    def halved(*args, **kwargs):
        out = inner(*args, **kwargs)
        out.logits = out.logits * 0.5
        return out

    model.forward = halved
    if trl_outside:  # TRL's wrapper leaves generation to the forward it found: this one
        trl_utils.add_fused_lm_head(model)
    refusal = instance_forward_refusal(model)
    assert refusal.reason == "patched_forward" and "halved" in refusal.detail
    paged, stock, msgs = _paged_and_stock(model)
    assert len(msgs) == 1 and "[patched_forward]" in msgs[0]
    _assert_equal(paged, stock)
