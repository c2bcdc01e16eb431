"""The step's flattened rows seen as a padded batch ``[N, L]``, for the scans and convolutions
that walk each sequence in order.

The engine hands a mixer ``hidden [T, D]`` with sequence ``i`` at rows
``cu_seqlens[i]:cu_seqlens[i+1]`` and no padding. The SSM / RG-LRU recurrences and the causal
convolutions are simplest and exact on ``[N, L, ...]`` (``L`` the longest chunk of the step):
``pack`` gathers the rows there, zero past each chunk's end; ``unpack`` gathers them back.
Everything is built on the device from ``cu_seqlens`` (no host read but ``max(seq_lens)``, which
the runner already holds), so a decode-only step (``L == 1``) is CUDA-graph safe.

A scan over the padded batch must leave a state unchanged at a padded position (the mixers
zero the step size ``dt`` there, or mask the update with ``valid``), so that the state after
position ``L - 1`` is the state after each chunk's own last token.

``PaddedMixer`` runs a step's multi-token chunks and its single tokens as two padded batches
(``split_step``), so that decodes are not padded to the longest prefill chunk. Nothing here
assumes an order of the sequences in the step (prefills first or interleaved).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from hf_paged.models.recurrent.base import RecurrentMeta, RecurrentMixer


@dataclass(frozen=True)
class PaddedLayout:
    """Where each ``(sequence, position)`` of ``[N, L]`` lives among the step's rows."""

    rows: torch.Tensor  # [N, L] int64: the row of (i, p), or T (a zero row) past chunk i's end
    valid: torch.Tensor  # [N, L] bool: p < seq_len[i]
    flat: torch.Tensor  # [T] int64: row r's index into the flattened [N * L]
    seq_lens: torch.Tensor  # [N] int64, on the device
    max_len: int  # L

    @classmethod
    def build(cls, meta: RecurrentMeta, num_rows: int) -> PaddedLayout:
        if not meta.seq_lens or min(meta.seq_lens) < 1:
            raise ValueError(f"meta.seq_lens={meta.seq_lens}: every chunk needs >= 1 token")
        cu = meta.cu_seqlens.long()  # [N + 1]
        max_len = max(meta.seq_lens)
        starts, lens = cu[:-1], cu[1:] - cu[:-1]  # [N]
        pos = torch.arange(max_len, device=cu.device)  # [L]
        valid = pos[None, :] < lens[:, None]  # [N, L]
        rows = torch.where(valid, starts[:, None] + pos[None, :], num_rows)
        r = torch.arange(num_rows, device=cu.device)  # [T]
        seq = torch.searchsorted(cu[1:], r, right=True)  # [T]: the sequence of each row
        flat = seq * max_len + (r - starts[seq])
        return cls(rows, valid, flat, lens, max_len)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, *F]`` -> ``[N, L, *F]``, zero past each chunk's end."""
        zero = x.new_zeros((1, *x.shape[1:]))
        return (
            torch.cat([x, zero])
            .index_select(0, self.rows.reshape(-1))
            .view(*self.rows.shape, *x.shape[1:])
        )

    def unpack(self, y: torch.Tensor) -> torch.Tensor:
        """``y [N, L, *F]`` -> ``[T, *F]`` (the valid positions, in row order)."""
        return y.reshape(-1, *y.shape[2:]).index_select(0, self.flat)


def initial_states(pool: torch.Tensor, meta: RecurrentMeta) -> torch.Tensor:
    """``pool [S + 1, *shape]`` -> each sequence's state before its chunk ``[N, *shape]``: its
    slot where ``has_initial_state``, zeros where the sequence starts here."""
    prev = pool.index_select(0, meta.state_indices)
    keep = meta.has_initial_state.view(-1, *([1] * (pool.dim() - 1)))
    return torch.where(keep, prev, torch.zeros_like(prev))


def split_step(meta: RecurrentMeta) -> list[tuple[slice | torch.Tensor, RecurrentMeta]]:
    """The step's multi-token chunks and its single tokens as separate parts ``(rows, meta)``
    (``rows`` a slice of the step's rows, or their indices where the two kinds interleave), so
    that single tokens are never padded to the longest chunk: a padded batch costs ``N * L``
    rows, and one long chunk beside many decodes would otherwise cost ``N`` times its rows.
    A step of one kind is one part (the step itself: no copy, CUDA-graph safe)."""
    lens = meta.seq_lens
    single = [n == 1 for n in lens]
    if all(single) or not any(single):
        return [(slice(0, sum(lens)), meta)]
    k = single.index(True)
    if all(single[k:]):  # chunks first, then single tokens: two slices
        split = sum(lens[:k])
        return [
            (slice(0, split), _part(meta, list(range(k)))),
            (slice(split, sum(lens)), _part(meta, list(range(k, len(lens))))),
        ]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    parts = []
    for kind in (False, True):
        seqs = [i for i, s in enumerate(single) if s == kind]
        rows = [r for i in seqs for r in range(starts[i], starts[i + 1])]
        parts.append((torch.tensor(rows, device=meta.cu_seqlens.device), _part(meta, seqs)))
    return parts


def _part(meta: RecurrentMeta, seqs: list[int]) -> RecurrentMeta:
    """Sequences ``seqs`` of the step (in order), their rows counted from the part's first."""
    lens = [meta.seq_lens[i] for i in seqs]
    dev = meta.cu_seqlens.device
    if seqs == list(range(seqs[0], seqs[-1] + 1)):  # contiguous: views, no host copy
        lo, hi = seqs[0], seqs[-1] + 1
        cu = meta.cu_seqlens[lo : hi + 1] - meta.cu_seqlens[lo]
        idx, has = meta.state_indices[lo:hi], meta.has_initial_state[lo:hi]
    else:
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device=dev)
        sel = torch.tensor(seqs, device=dev)
        idx, has = meta.state_indices[sel], meta.has_initial_state[sel]
    return RecurrentMeta(cu, idx, has, sum(1 for n in lens if n > 1), lens)


class PaddedMixer(RecurrentMixer):
    """A mixer that runs each part of the step (``split_step``) as a padded batch:
    subclasses implement ``forward_part`` on one part's rows and meta."""

    def forward(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]`` (the contract's ``forward``)."""
        parts = split_step(meta)
        if len(parts) == 1:
            return self.forward_part(hidden, meta, states)
        out = torch.empty_like(hidden)
        for rows, part in parts:
            out[rows] = self.forward_part(hidden[rows], part, states)
        return out

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        raise NotImplementedError
