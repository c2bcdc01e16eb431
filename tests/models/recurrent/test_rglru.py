"""RecurrentGemma's recurrent block (conv1d + RG-LRU): its state shapes and what it refuses. Its
parity with stock ``RecurrentGemmaRecurrentBlock`` on every step shape is ``test_mixers.py``'s,
with every family's."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.rglru import RGLRUMixer


@pytest.mark.parametrize("case", ["recurrent_gemma"], indirect=True)
def test_state_specs(case):
    mixer, _, _ = case
    conv, rec = mixer.state_specs()
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (96, 3), torch.float32)
    assert (rec.name, rec.shape, rec.dtype) == ("recurrent", (96,), torch.float32)


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not an RG-LRU block"):
        RGLRUMixer.from_hf(torch.nn.Linear(4, 4))
