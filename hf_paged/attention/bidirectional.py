"""Bidirectional ranges: spans of a sequence whose tokens attend to each other both ways.

Gemma 3 lets the tokens of one image see each other in full while the rest of the sequence stays
causal. Stock builds ``OR(causal, same image)`` for full-attention layers and
``AND(sliding window, OR(causal, same image))`` for sliding ones (transformers'
``create_masks_for_vision_model``), so a query inside an image also sees the image's later keys,
and the window still bounds how far back any query looks.

A range is a half-open ``(start, end)`` of sequence positions. The torch reference builds its
mask from the ranges themselves; the Triton prefill kernel reads one int per query, the end of
the keys it sees (:func:`query_key_ends`). Both hold only because the scheduler never ends a
prefill chunk inside a range: a query inside a range has every key of it in the cache or in its
own chunk. Decode tokens follow the prompt and are never inside one. Pure Python (no torch):
the integration finds the ranges at admission and the step builder turns them into ends.
"""

from __future__ import annotations

from collections.abc import Sequence


def ranges_from_token_types(token_type_ids: Sequence[int], kind: int = 1) -> list[tuple[int, int]]:
    """The maximal runs of ``kind`` in one row of ``token_type_ids``, as ``(start, end)``.

    Stock groups image tokens the same way (``get_block_sequence_ids_for_mask``): a run of
    image tokens is one block, so two images with no text token between them are one range.
    """
    out: list[tuple[int, int]] = []
    start = None
    for pos, t in enumerate(token_type_ids):
        if t == kind and start is None:
            start = pos
        elif t != kind and start is not None:
            out.append((start, pos))
            start = None
    if start is not None:
        out.append((start, len(token_type_ids)))
    return out


def check_ranges(ranges: Sequence[tuple[int, int]], name: str = "bidirectional_ranges") -> None:
    """Raise ``ValueError`` unless ``ranges`` are sorted, disjoint, non-empty and >= 0."""
    prev_end = 0
    for start, end in ranges:
        if not prev_end <= start < end:
            raise ValueError(
                f"{name}={list(ranges)} is not allowed: ranges must be sorted, disjoint, "
                "non-empty (start < end) half-open position ranges starting at >= 0"
            )
        prev_end = end


def query_key_ends(
    ranges: Sequence[Sequence[tuple[int, int]]],  # per sequence
    cu_seqlens_q: Sequence[int],  # [num_seqs + 1]
    context_lens: Sequence[int],  # [num_seqs]
) -> list[int] | None:
    """Per new query of a ragged batch, one past the last key position it sees.

    Query ``j`` of sequence ``i`` sits at ``p = context_lens[i] - q_len_i + j``; it sees keys
    ``< p + 1``, or ``< end`` when ``start <= p < end`` for one of sequence ``i``'s ranges.

    Returns:
        ``[num_tokens]`` ints, or None when no range holds a query (the batch is causal).

    Raises:
        ValueError: a range holding a query ends past its sequence's context (a prefill chunk
            ended inside it), or ranges that are not sorted and disjoint.
    """
    ends: list[int] = []
    found = False
    for i, seq_ranges in enumerate(ranges):
        ctx, q_len = context_lens[i], cu_seqlens_q[i + 1] - cu_seqlens_q[i]
        first = ctx - q_len
        row = list(range(first + 1, ctx + 1))
        check_ranges(seq_ranges)
        for start, end in seq_ranges:
            lo, hi = max(start, first), min(end, ctx)
            if lo >= hi:
                continue  # no query of this chunk inside it
            if end > ctx:
                raise ValueError(
                    f"bidirectional range [{start}, {end}) of sequence {i} holds queries but "
                    f"ends past its context ({ctx} tokens): a prefill chunk may not end inside "
                    "a bidirectional range (the scheduler keeps each one whole)"
                )
            row[lo - first : hi - first] = [end] * (hi - lo)
            found = True
        ends.extend(row)
    return ends if found else None
