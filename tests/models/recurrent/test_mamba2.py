"""Mamba 2's mixer (Mamba2, Bamba, GraniteMoeHybrid, Nemotron-H, Falcon-H1 in three norm modes):
its state shapes, what it refuses, and the chunked SSD == its own per-token recurrence. Its
parity with stock on every step shape is ``test_mixers.py``'s, with every family's."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.mamba2 import Mamba2Mixer
from hf_paged.models.recurrent.ssd import ssd_chunked, ssd_step
from tests.models.recurrent.ssm_cases import (
    MAMBA2,
    close,
)


@pytest.mark.parametrize("case", MAMBA2, indirect=True)
def test_state_specs(case):
    mixer, _, _ = case
    conv, rec = mixer.state_specs()
    # conv over x (128) and B, C (2 groups x 8)
    assert (conv.name, conv.shape, conv.dtype) == ("conv", (160, 3), torch.float32)
    assert (rec.name, rec.shape, rec.dtype) == ("recurrent", (8, 16, 8), torch.float32)


@pytest.mark.parametrize("chunk", [1, 4, 5, 64])
def test_ssd_chunked_equals_steps(chunk):
    """The block form == the per-token recurrence, from non-zero states, with ragged ends."""
    g = torch.Generator().manual_seed(0)
    n, length, heads, p, groups, s = 3, 13, 4, 5, 2, 6
    x = torch.randn(n, length, heads, p, generator=g)
    dt = torch.rand(n, length, heads, generator=g)
    dt[1, 9:] = 0.0  # a chunk that ends early: its state must hold
    a = -torch.rand(heads, generator=g) * 2
    b, c = (torch.randn(n, length, groups, s, generator=g) for _ in range(2))
    h0 = torch.randn(n, heads, p, s, generator=g)
    y, h = ssd_chunked(x, dt, a, b, c, h0, chunk)
    ys, hs = [], h0
    for t in range(length):
        yt, hs = ssd_step(x[:, t], dt[:, t], a, b[:, t], c[:, t], hs)
        ys.append(yt)
    close(y, torch.stack(ys, dim=1), "outputs")
    close(h, hs, "final states")


def test_refuses_other_modules():
    with pytest.raises(ValueError, match="not a Mamba 2 mixer"):
        Mamba2Mixer.from_hf(torch.nn.Linear(4, 4))


def test_time_step_limit_runs_stock_by_name(clean_dispatch):
    """Stock clamps ``dt`` to ``time_step_limit`` for the prompt but not in its decode steps:
    a non-default limit would change the engine's tokens, so the call runs stock, named."""
    from hf_paged import release
    from hf_paged.testing import build_tiny, stock_and_paged

    _, hf = build_tiny("mamba2", time_step_limit=(0.01, 0.5))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    stock, paged, _, _, msgs = stock_and_paged(
        hf, expect_fallback=True, input_ids=ids, attention_mask=torch.ones_like(ids),
        max_new_tokens=6, do_sample=False, pad_token_id=0,
    )  # fmt: skip
    release(hf)
    assert any("time_step_limit=(0.01, 0.5) is not allowed" in m for m in msgs), msgs
    assert torch.equal(stock, paged)
