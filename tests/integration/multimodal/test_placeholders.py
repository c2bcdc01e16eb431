"""Placeholder ranges in stock's masked_scatter order: an image may span several runs
(Idefics3's crops split by row tokens) and a run may hold several images."""

from __future__ import annotations

import pytest

from hf_paged.integration.multimodal.placeholders import Piece, assign, placeholder_runs

T = 9  # the placeholder id


def test_runs():
    assert placeholder_runs([1, T, T, 2, T, 3, T, T, T], T) == [(1, 2), (4, 1), (6, 3)]
    assert placeholder_runs([1, 2], T) == []


def test_rows_in_order_images_in_order():
    rows = [[1, T, T, 2], [T, T, T, 3, T]]
    # image 0 has 3 rows: row 0's run and the first of row 1's; image 1 the rest
    got = assign(rows, T, [3, 3])
    assert got == [
        [Piece(1, 2, 0, 0)],
        [Piece(0, 1, 0, 2), Piece(1, 2, 1, 0), Piece(4, 1, 1, 2)],
    ]


def test_a_count_mismatch_raises_stocks_message():
    with pytest.raises(ValueError, match="tokens: 3, features: 4"):
        assign([[T, T, T]], T, [4])
    with pytest.raises(ValueError, match="tokens: 0, features: 2"):
        assign([[1, 2]], T, [2])
