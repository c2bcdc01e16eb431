"""Reading a request's KV back out of the paged cache: the keys and values at given slots, per
KV layer (``LLMEngine.request_kv``; stock's returned cache is built from them)."""

from __future__ import annotations

import torch


def gather_kv(kv_cache, slots: list[list[int]], device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``[(k [T, H, D], v [T, H, Dv])]`` per KV layer of ``kv_cache`` (a ``KVCache``): the rows
    at ``slots`` (``RequestTable.kv_slots``), the requests one after another, one
    ``index_select`` per layer."""
    flat = [s for per_request in slots for s in per_request]
    index = torch.tensor(flat, dtype=torch.long, device=device)  # [T]
    out = []
    for i in range(len(kv_cache)):
        k, v = kv_cache[i]  # [num_blocks, block_size, H, D]
        out.append((k.flatten(0, 1).index_select(0, index), v.flatten(0, 1).index_select(0, index)))
    return out
