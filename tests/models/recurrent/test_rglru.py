"""RecurrentGemma's recurrent block (conv1d + RG-LRU) on the engine's step == stock
``RecurrentGemmaRecurrentBlock`` (fp32, CPU): whole prompt, chunked prefill, a mixed step,
decode after prefill (stock's own ``use_cache`` path, its states kept on the module)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.rglru import RGLRUMixer
from tests.models.recurrent.ssm_cases import (
    build_module,
    check_chunked,
    check_decode,
    check_mixed,
    check_whole,
)


@pytest.fixture(scope="module")
def case():
    module, config = build_module("recurrent_gemma")
    return RGLRUMixer.from_hf(module, config), module, config


def test_state_specs(case):
    mixer, _, _ = case
    conv, rec = mixer.state_specs()
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (96, 3), torch.float32)
    assert (rec.name, rec.shape, rec.dtype) == ("recurrent", (96,), torch.float32)


def test_whole_prompt(case):
    check_whole(*case[:2])


def test_one_token_prompt(case):
    """A prompt of one token is all reset: state = x * input gate."""
    check_whole(*case[:2], length=1)


def test_chunked_prefill(case):
    mixer, module, _ = case
    check_chunked(mixer, module, [1, 3, mixer.kernel - 1, mixer.kernel, 16])


@pytest.mark.parametrize("order", ["prefills_first", "interleaved"])
def test_mixed_step(case, order):
    check_mixed(*case[:2], order)


def test_decode_after_prefill(case):
    check_decode(*case)


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not an RG-LRU block"):
        RGLRUMixer.from_hf(torch.nn.Linear(4, 4))
