"""Mamba 1 on the engine's step == the stock mixers of Mamba, Falcon-Mamba and Jamba (fp32,
CPU): whole prompt, chunked prefill, a mixed step, decode after prefill."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.mamba import MambaMixer
from tests.models.recurrent.ssm_cases import (
    MAMBA1,
    build_module,
    check_chunked,
    check_decode,
    check_mixed,
    check_whole,
)


@pytest.fixture(scope="module", params=MAMBA1)
def case(request):
    module, config = build_module(request.param)
    return MambaMixer.from_hf(module, config), module, config


def test_state_specs(case):
    mixer, _, _ = case
    conv, rec = mixer.state_specs()
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (128, 3), torch.float32)
    assert (rec.name, rec.shape, rec.dtype) == ("recurrent", (128, 8), torch.float32)


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
    with pytest.raises(ValueError, match="not a Mamba 1 mixer"):
        MambaMixer.from_hf(torch.nn.Linear(4, 4))
