"""Comparing a paged call's returned cache with stock's (the generate-contract tests).

Stock's cache holds every token but the last in the call's padded layout; its padding slots
hold what stock's forward computed for pad tokens, the paged call's zeros (masked, never read),
so contents are compared at attended positions and shapes everywhere."""

from __future__ import annotations

import torch
from transformers import StaticCache


def grown_mask(mask: torch.Tensor, length: int, rows: int) -> torch.Tensor:
    """``[rows, length]`` bool: the prompt's ``mask`` ``[B, L]`` (rows repeated to ``rows``)
    grown by attended columns, as stock's mask grows with every generated token."""
    mask = mask.repeat_interleave(rows // mask.shape[0], dim=0).bool()
    return torch.nn.functional.pad(mask, (0, length - mask.shape[1]), value=True)


def assert_same_cache(stock, paged, mask: torch.Tensor, tol: float = 1e-5) -> None:
    """Same class, layer classes, lengths and shapes; K and V within ``tol`` where ``mask``
    ``[N, S]`` attends (a sliding layer keeps the last positions, a static one the first); a
    recurrent layer's conv and recurrent states within ``tol``."""
    assert type(paged) is type(stock)
    assert [type(a) for a in paged.layers] == [type(a) for a in stock.layers]
    assert int(paged.get_seq_length()) == int(stock.get_seq_length()) == mask.shape[1]
    for a, b in zip(stock.layers, paged.layers, strict=True):
        if hasattr(a, "conv_states"):  # a recurrent layer: its states, rows in the batch order
            for x, y in (*zip(a.conv_states, b.conv_states), *zip(a.recurrent_states,
                                                                    b.recurrent_states)):  # fmt: skip
                assert (x is None) == (y is None)
                if x is not None:
                    torch.testing.assert_close(y, x, atol=tol, rtol=tol)
        if getattr(a, "keys", None) is None:
            continue
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        n = a.keys.shape[-2]
        keep = mask[:, :n] if isinstance(stock, StaticCache) else mask[:, -n:]
        keep = torch.nn.functional.pad(keep, (0, n - keep.shape[1]))  # static: unused tail
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = x.transpose(1, 2)[keep], y.transpose(1, 2)[keep]
            torch.testing.assert_close(y, x, atol=tol, rtol=tol)
