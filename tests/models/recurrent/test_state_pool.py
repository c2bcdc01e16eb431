"""``StatePool``: slot bookkeeping, zeroing on alloc, fork copies, bytes per slot."""

from __future__ import annotations

import pytest
import torch

from hf_paged.models.recurrent.base import StateSpec
from hf_paged.models.recurrent.state_pool import StatePool, bytes_per_slot

SPECS = [
    [StateSpec("conv", (6, 3), torch.float32), StateSpec("recurrent", (2, 4, 5), torch.float32)],
    [StateSpec("conv", (6, 3), torch.bfloat16)],
]


def test_shapes_and_dummy_slot():
    pool = StatePool(SPECS, num_slots=3, device="cpu")
    assert pool.layers[0]["conv"].shape == (4, 6, 3)
    assert pool.layers[0]["recurrent"].shape == (4, 2, 4, 5)
    assert pool.layers[1]["conv"].dtype == torch.bfloat16
    slots = [pool.alloc() for _ in range(3)]
    assert sorted(slots) == [1, 2, 3]  # slot 0 is never handed out
    with pytest.raises(RuntimeError, match="no free state slot"):
        pool.alloc()


def test_alloc_zeroes_and_free_reuses():
    pool = StatePool(SPECS, num_slots=2, device="cpu")
    a = pool.alloc()
    pool.layers[0]["recurrent"][a].fill_(7.0)
    pool.layers[1]["conv"][a].fill_(3.0)
    pool.free(a)
    with pytest.raises(ValueError, match="not in use"):
        pool.free(a)
    b = pool.alloc()
    assert b == a
    assert pool.layers[0]["recurrent"][b].abs().sum() == 0
    assert pool.layers[1]["conv"][b].abs().sum() == 0


def test_fork_copies_every_layer():
    pool = StatePool(SPECS, num_slots=3, device="cpu")
    a = pool.alloc()
    g = torch.Generator().manual_seed(0)
    for states in pool.layers:
        for t in states.values():
            t[a].copy_(torch.randn(t[a].shape, generator=g).to(t.dtype))
    b = pool.fork(a)
    assert b != a
    for states in pool.layers:
        for t in states.values():
            assert torch.equal(t[b], t[a])
    pool.layers[0]["conv"][b].add_(1.0)  # a copy, not a view
    assert not torch.equal(pool.layers[0]["conv"][b], pool.layers[0]["conv"][a])
    with pytest.raises(ValueError, match="not in use"):
        pool.fork(3 if b != 3 and a != 3 else 2)


def test_bytes_per_slot():
    expected = (6 * 3 + 2 * 4 * 5) * 4 + 6 * 3 * 2
    assert bytes_per_slot(SPECS) == expected
    pool = StatePool(SPECS, num_slots=2, device="cpu")
    assert pool.slot_bytes == expected
    total = sum(t.numel() * t.element_size() for s in pool.layers for t in s.values())
    assert total == expected * 3  # num_slots + the dummy


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_slots=0"):
        StatePool(SPECS, num_slots=0, device="cpu")
    dup = [[StateSpec("conv", (1,), torch.float32), StateSpec("conv", (2,), torch.float32)]]
    with pytest.raises(ValueError, match="distinct"):
        StatePool(dup, num_slots=1, device="cpu")
