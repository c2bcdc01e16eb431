"""LFM2's short convolution (with and without biases): its state shape and what it refuses. Its
parity with stock ``Lfm2ShortConv`` on every step shape is ``test_mixers.py``'s, with every
family's."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.short_conv import ShortConvMixer


@pytest.mark.parametrize("case", ["lfm2", "lfm2_no_bias"], indirect=True)
def test_state_specs(case):
    mixer, module, _ = case
    (spec,) = mixer.state_specs()
    assert (spec.name, spec.shape, spec.dtype) == ("conv", (64, 2), torch.float32)


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not an LFM2 short convolution"):
        ShortConvMixer.from_hf(torch.nn.Linear(4, 4))
