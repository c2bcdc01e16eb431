"""Placeholder ranges: where each image's feature rows go in each prompt row. No model calls.

The processor expanded every image into a run of ``image_token_id``; stock merges with
``inputs_embeds.masked_scatter(image_mask, features)``, which hands the features, concatenated in
image order, to the placeholder positions in row-major order. ``assign`` reproduces that order on
the rows' attended tokens (left padding stripped) and cuts each run where one image's rows end
and the next one's begin, so every piece is ``(offset in the row, length, image, first row of the
image)``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Piece:
    """``length`` placeholder positions from ``offset`` of a row take rows ``start ..`` of
    image ``image``."""

    offset: int
    length: int
    image: int
    start: int


def placeholder_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """``(offset, length)`` of each run of ``token_id`` in ``ids``."""
    runs, at, n = [], 0, len(ids)
    while at < n:
        if ids[at] != token_id:
            at += 1
            continue
        end = at
        while end < n and ids[end] == token_id:
            end += 1
        runs.append((at, end - at))
        at = end
    return runs


def assign(rows: list[list[int]], token_id: int, image_sizes: list[int]) -> list[list[Piece]]:
    """Each row's pieces, handing out the images' rows (``image_sizes[i]`` rows for image ``i``)
    in stock's ``masked_scatter`` order.

    Args:
        rows: each row's attended token ids (padding stripped).
        token_id: the image placeholder id.
        image_sizes: feature rows per image, in the call's image order.

    Raises:
        ValueError: the placeholders and the features differ in number (stock's message).
    """
    runs = [placeholder_runs(r, token_id) for r in rows]
    num_tokens = sum(n for row in runs for _, n in row)
    num_features = sum(image_sizes)
    if num_tokens != num_features:
        raise ValueError(
            f"Image features and image tokens do not match, tokens: {num_tokens}, "
            f"features: {num_features}"
        )
    out: list[list[Piece]] = []
    image, used = 0, 0  # the image being handed out, its rows already placed
    for row in runs:
        pieces = []
        for offset, length in row:
            while length:
                while image_sizes[image] == used:  # next image (skips images of 0 rows)
                    image, used = image + 1, 0
                take = min(length, image_sizes[image] - used)
                pieces.append(Piece(offset, take, image, used))
                offset, length, used = offset + take, length - take, used + take
        out.append(pieces)
    return out
