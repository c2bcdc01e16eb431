"""One paged step by hand, without the engine: a zeroed KV cache, attention metadata with
consecutive blocks per sequence, and a forward of a ``PagedModel`` over a ragged batch."""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.attention.base import AttentionMetadata
from hf_paged.attention.kv_cache import KVCache


def make_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype=None) -> KVCache:
    """A zeroed ``KVCache`` for ``model.kv_cache_specs`` (as the ModelRunner allocates it), in
    the model's parameter dtype and device unless ``dtype`` is given."""
    param = next(model.parameters())
    return KVCache(model.kv_cache_specs, num_blocks, block_size, dtype or param.dtype, param.device)


def build_metadata(
    q_lens: list[int],
    context_lens: list[int],
    block_size: int,
    max_blocks_per_seq: int,
    device: str | torch.device = "cpu",
    kv_cache: KVCache | None = None,
) -> tuple[AttentionMetadata, torch.Tensor]:
    """Metadata for a ragged step where sequence i computes its last ``q_lens[i]`` tokens of
    ``context_lens[i]``; sequence i owns blocks ``[i * max_blocks_per_seq, (i+1) * ...)``.

    Returns:
        (meta, positions [T] int64).
    """
    positions, slots, cu = [], [], [0]
    tables = []
    for i, (q, c) in enumerate(zip(q_lens, context_lens, strict=True)):
        if c > max_blocks_per_seq * block_size:
            raise ValueError(f"context_len {c} does not fit {max_blocks_per_seq} blocks")
        table = [i * max_blocks_per_seq + b for b in range(max_blocks_per_seq)]
        tables.append(table)
        for p in range(c - q, c):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
        cu.append(cu[-1] + q)
    meta = AttentionMetadata(
        is_decode=all(q == 1 for q in q_lens),
        num_seqs=len(q_lens),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        max_seqlen_q=max(q_lens),
        max_context_len=max(context_lens),
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=list(context_lens),
        kv_cache=kv_cache,
    )
    return meta, torch.tensor(positions, dtype=torch.int64, device=device)


def run_step(
    model: nn.Module,
    kv_cache: KVCache,
    seqs: list[list[int]],
    q_lens: list[int],
    block_size: int,
    max_blocks_per_seq: int,
) -> list[torch.Tensor]:
    """Run one ragged step computing the last ``q_lens[i]`` tokens of each ``seqs[i]`` (earlier
    tokens must already be in ``kv_cache``) and return each sequence's logits [q_len, vocab]
    (None each on tensor-parallel ranks other than 0)."""
    lens = [len(s) for s in seqs]
    meta, positions = build_metadata(
        q_lens, lens, block_size, max_blocks_per_seq, kv_cache=kv_cache
    )
    input_ids = torch.tensor(
        [t for s, q in zip(seqs, q_lens, strict=True) for t in s[len(s) - q :]]
    )
    with torch.inference_mode():
        logits = model.compute_logits(model(input_ids, positions, meta))
    if logits is None:  # a tensor-parallel rank other than 0
        return [None] * len(seqs)
    cu = meta.cu_seqlens_q_cpu
    return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]
