"""LFM2's short convolution on the engine's step == stock ``Lfm2ShortConv`` (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.short_conv import ShortConvMixer
from tests.models.recurrent.ssm_cases import (
    build_module,
    check_chunked,
    check_decode,
    check_mixed,
    check_whole,
)


@pytest.fixture(scope="module", params=[True, False], ids=["bias", "no_bias"])
def case(request):
    module, config = build_module("lfm2")
    if not request.param:
        module.conv.bias = None
        module.in_proj.bias, module.out_proj.bias = None, None
    return ShortConvMixer.from_hf(module, config), module, config


def test_state_specs(case):
    mixer, module, _ = case
    (spec,) = mixer.state_specs()
    assert (spec.name, spec.shape, spec.dtype) == ("conv", (64, 2), torch.float32)


def test_whole_prompt(case):
    check_whole(*case[:2])


def test_chunked_prefill(case):
    mixer, module, _ = case
    check_chunked(mixer, module, [1, 3, mixer.kernel - 1, mixer.kernel, 16])


@pytest.mark.parametrize("order", ["prefills_first", "interleaved"])
def test_mixed_step(case, order):
    check_mixed(*case[:2], order)


def test_decode_after_prefill(case):
    check_decode(*case)


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not an LFM2 short convolution"):
        ShortConvMixer.from_hf(torch.nn.Linear(4, 4))
