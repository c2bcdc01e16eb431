"""Mamba 1's mixer (Mamba, Falcon-Mamba, Jamba): its state shapes and what it refuses. Its
parity with stock on every step shape is ``test_mixers.py``'s, with every family's."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.mamba import MambaMixer
from tests.models.recurrent.ssm_cases import (
    MAMBA1,
)


@pytest.mark.parametrize("case", MAMBA1, indirect=True)
def test_state_specs(case):
    mixer, _, _ = case
    conv, rec = mixer.state_specs()
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (128, 3), torch.float32)
    assert (rec.name, rec.shape, rec.dtype) == ("recurrent", (128, 8), torch.float32)


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not a Mamba 1 mixer"):
        MambaMixer.from_hf(torch.nn.Linear(4, 4))
