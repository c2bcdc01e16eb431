"""Prompt embeddings: rows a request feeds the decoder instead of ``embed(id)`` at some prompt
positions, and the positions it runs at when they are not ``0..L-1``. No torch (tensors are held
and sliced, never created here).

A request's ``PromptEmbeds`` names disjoint ranges of its prompt (``EmbedRange``: offset, length,
content key) and holds their rows back to back. Every other prompt position, and every generated
token, is embedded from its id by the model as usual; decode always runs on ids. The runner gets
per chunk only the rows inside the chunk's window (``chunk_embeds``), so a range may be split
across prefill chunks.

Two shapes of caller use it:

* dense rows (``generate(inputs_embeds=...)``): one range over the whole prompt
  (``PromptEmbeds.dense``); the ids are placeholders the caller chose.
* multimodal prompts: the ids are the text with each image's placeholder run expanded, and one
  range per image carries its encoder features (``hf_paged/integration/multimodal``).

Prefix caching: a KV block's hash covers its token ids and, for every range overlapping it,
``("embeds", key, range offset - block start)`` (``block_extra_keys``), so equal ids with other
rows never share KV, and the same rows at the same place do. A range without a key gets a key of
its own that nothing else has (never shared).

Positions (Qwen's multimodal rotary, M-RoPE): ``positions`` ``[3, L]`` gives the prompt's
positions per rotary section, and ``position_delta`` is added to every position from ``L`` on
(generated tokens), on all three rows. Extra per-layer rows (Qwen3-VL's DeepStack) ride along with
their range's rows in ``deepstack`` ``[num_layers, R, hidden]``.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

_unshared = itertools.count()  # keys of ranges given without one: each its own


@dataclass(frozen=True)
class EmbedRange:
    """Prompt positions ``offset .. offset + length - 1`` take rows instead of their ids."""

    offset: int
    length: int
    key: object = None  # content key (an image hash, a digest of the rows); None = never shared


@dataclass
class PromptEmbeds:
    """What a prompt feeds the decoder besides its ids (``EngineRequest.prompt_embeds``).

    Attributes:
        ranges: disjoint, sorted by offset, inside the prompt.
        rows: ``[sum(length), hidden]`` tensor; range ``i``'s rows follow range ``i - 1``'s.
        deepstack: ``[num_layers, sum(length), hidden]`` rows added to the hidden states of the
            first ``num_layers`` decoder layers at the ranges' positions (Qwen3-VL), or None.
        positions: ``[3, L]`` int positions of the prompt (M-RoPE), or None for ``0..L-1``.
        position_delta: added to positions ``>= L`` (generated tokens) when ``positions`` is set.
    """

    ranges: list[EmbedRange]
    rows: object
    deepstack: object | None = None
    positions: object | None = None
    position_delta: int = 0
    _starts: list[int] = field(default_factory=list, repr=False)  # row index of each range

    def __post_init__(self):
        self.ranges = [
            r
            if r.key is not None
            else EmbedRange(r.offset, r.length, ("unshared", next(_unshared)))
            for r in self.ranges
        ]
        self._starts = list(itertools.accumulate((r.length for r in self.ranges), initial=0))

    @classmethod
    def dense(cls, rows, key=None) -> PromptEmbeds:
        """Every prompt position from ``rows`` ``[L, hidden]`` (``generate(inputs_embeds=)``)."""
        return cls([EmbedRange(0, int(rows.shape[0]), key)], rows)

    @property
    def num_rows(self) -> int:
        return self._starts[-1]

    def validate(self, prompt_len: int, hidden_size: int) -> None:
        """Raises ValueError naming what does not fit a prompt of ``prompt_len`` tokens and a
        decoder of ``hidden_size``: a range outside the prompt or overlapping another, rows that
        are not ``[sum of range lengths, hidden_size]``, positions that are not ``[3, L]``."""
        end = 0
        for i, r in enumerate(self.ranges):
            if r.length < 1 or r.offset < end or r.offset + r.length > prompt_len:
                raise ValueError(
                    f"prompt_embeds.ranges[{i}]={r} is not allowed: ranges must be non-empty, "
                    f"sorted, disjoint and inside the prompt of {prompt_len} tokens"
                )
            end = r.offset + r.length
        shape = tuple(getattr(self.rows, "shape", ()))
        if shape != (self.num_rows, hidden_size):
            raise ValueError(
                f"prompt_embeds.rows of shape {list(shape)} is not allowed: must be "
                f"[{self.num_rows}, {hidden_size}] (the ranges' total length, the decoder's "
                "hidden_size)"
            )
        ds = self.deepstack
        if ds is not None and (ds.dim() != 3 or tuple(ds.shape[1:]) != shape):
            raise ValueError(
                f"prompt_embeds.deepstack of shape {list(ds.shape)} is not allowed: must be "
                f"[num_layers, {self.num_rows}, {hidden_size}]"
            )
        pos = self.positions
        if pos is not None and tuple(pos.shape) != (3, prompt_len):
            raise ValueError(
                f"prompt_embeds.positions of shape {list(pos.shape)} is not allowed: must be "
                f"[3, {prompt_len}] (one row per rotary section)"
            )


def check_prompt_embeds(pe, prompt_len: int, hf_config, mrope: bool) -> None:
    """``add_request``'s check of ``prompt_embeds`` for a prompt of ``prompt_len`` tokens on a
    model of ``hf_config`` (``mrope``: its rotary takes ``[3, L]`` positions).

    Raises:
        TypeError: not a ``PromptEmbeds``.
        ValueError: what ``PromptEmbeds.validate`` names, or positions for a model without
            M-RoPE.
    """
    if not isinstance(pe, PromptEmbeds):
        raise TypeError(f"prompt_embeds={type(pe).__name__} is not allowed: must be PromptEmbeds")
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    pe.validate(prompt_len, text.hidden_size)
    if pe.positions is not None and not mrope:
        raise ValueError(
            "prompt_embeds.positions is not allowed: this model's rotary takes one position "
            "per token (only M-RoPE models take [3, L] positions); leave it None"
        )


@dataclass
class ChunkEmbeds:
    """The part of a request's ``PromptEmbeds`` inside one chunk, as the runner takes it."""

    offsets: list[int]  # per row: its index inside the chunk
    rows: object  # [R, hidden]
    deepstack: object | None = None  # [num_layers, R, hidden]


def chunk_embeds(pe: PromptEmbeds, start: int, n: int) -> ChunkEmbeds | None:
    """The rows of positions ``start .. start + n - 1`` (None when no range overlaps them)."""
    offsets, pieces, ds = [], [], []
    for r, first in zip(pe.ranges, pe._starts):
        lo, hi = max(start, r.offset), min(start + n, r.offset + r.length)
        if lo >= hi:
            continue
        a, b = first + lo - r.offset, first + hi - r.offset
        offsets.extend(range(lo - start, hi - start))
        pieces.append(pe.rows[a:b])
        if pe.deepstack is not None:
            ds.append(pe.deepstack[:, a:b])
    if not pieces:
        return None
    rows = pieces[0] if len(pieces) == 1 else _torch().cat(pieces)
    deep = None if not ds else (ds[0] if len(ds) == 1 else _torch().cat(ds, dim=1))
    return ChunkEmbeds(offsets, rows, deep)


def _torch():
    """torch, already loaded by whoever made the tensors (this module imports no torch)."""
    return sys.modules["torch"]


def chunk_positions(pe: PromptEmbeds, prompt_len: int, start: int, n: int):
    """M-RoPE positions ``[3, n]`` of positions ``start .. start + n - 1``, or None when the
    request has plain positions: the prompt's from ``pe.positions``, later ones ``p + delta``."""
    if pe is None or pe.positions is None:
        return None
    end = start + n
    if end <= prompt_len:
        return pe.positions[:, start:end]
    torch = _torch()
    tail = torch.arange(max(start, prompt_len), end, dtype=pe.positions.dtype) + pe.position_delta
    tail = tail.to(pe.positions.device).expand(3, -1)
    if start >= prompt_len:
        return tail
    return torch.cat([pe.positions[:, start:prompt_len], tail], dim=1)


def block_extra_keys(pe: PromptEmbeds | None, block_start: int, block_end: int) -> tuple:
    """``("embeds", key, offset - block_start)`` of every range overlapping a block's positions
    (part of its prefix-cache key); ``()`` for none."""
    if pe is None:
        return ()
    return tuple(
        ("embeds", r.key, r.offset - block_start)
        for r in pe.ranges
        if r.offset < block_end and r.offset + r.length > block_start
    )
