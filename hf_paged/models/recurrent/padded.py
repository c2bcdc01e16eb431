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

``PaddedMixer`` runs a step's prefill chunks and its decodes as two padded batches
(``split_step``), so that single-token decodes are not padded to the longest prefill chunk.
"""

from __future__ import annotations

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


def split_step(meta: RecurrentMeta) -> list[tuple[int, int, RecurrentMeta]]:
    """The step's prefill chunks and its decodes as separate parts ``(first row, end row,
    meta)``, each non-empty, so that the decodes (one token each) are never padded to the
    longest prefill chunk: a padded batch costs ``N * L`` rows, and a step of one long chunk
    beside many decodes would otherwise cost ``N`` times its rows."""
    n, num_prefills = len(meta.seq_lens), meta.num_prefills
    if num_prefills in (0, n):
        return [(0, sum(meta.seq_lens), meta)]
    split = sum(meta.seq_lens[:num_prefills])
    return [
        (0, split, _part(meta, 0, num_prefills, num_prefills)),
        (split, split + sum(meta.seq_lens[num_prefills:]), _part(meta, num_prefills, n, 0)),
    ]


def _part(meta: RecurrentMeta, lo: int, hi: int, num_prefills: int) -> RecurrentMeta:
    """Sequences ``lo:hi`` of the step, their rows counted from the part's first."""
    return RecurrentMeta(
        cu_seqlens=meta.cu_seqlens[lo : hi + 1] - meta.cu_seqlens[lo],
        state_indices=meta.state_indices[lo:hi],
        has_initial_state=meta.has_initial_state[lo:hi],
        num_prefills=num_prefills,
        seq_lens=meta.seq_lens[lo:hi],
    )


class PaddedMixer(RecurrentMixer):
    """A mixer that runs each part of the step (``split_step``) as a padded batch:
    subclasses implement ``forward_part`` on one part's rows and meta."""

    def forward(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]`` (the contract's ``forward``)."""
        outs = [self.forward_part(hidden[a:b], part, states) for a, b, part in split_step(meta)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def forward_part(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        raise NotImplementedError
