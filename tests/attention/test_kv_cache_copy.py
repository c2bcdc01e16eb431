"""``KVCache.copy_blocks`` (copy on write of forked blocks): every layer's K and V of each source
block land on its destination, in both storage layouts, sources read before any write, nothing
else touched."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention.kv_cache import KVCache, KVCacheSpec

SPECS = {
    # one allocation [2, layers, blocks, ...] holding K and V
    "uniform": [KVCacheSpec(2, 8, 8)] * 3,
    # K and V apart (MLA-like head dims), plus a second spec: three allocations
    "mixed": [KVCacheSpec(2, 12, 8), KVCacheSpec(1, 8, 8), KVCacheSpec(2, 12, 8)],
}


def filled(specs) -> KVCache:
    cache = KVCache(specs, num_blocks=6, block_size=4, dtype=torch.float32, device="cpu")
    g = torch.Generator().manual_seed(0)
    for t in cache.storage:
        t.copy_(torch.randn(t.shape, generator=g))
    return cache


def snapshot(cache: KVCache):
    return [(k.clone(), v.clone()) for k, v in (cache[i] for i in range(len(cache)))]


@pytest.mark.parametrize("layout", sorted(SPECS))
def test_copy_blocks_moves_each_source_onto_its_destination(layout):
    cache = filled(SPECS[layout])
    before = snapshot(cache)
    # block 1 -> 4 and 3 -> 1 in one call: 4 gets the old block 1, not block 3's copy
    cache.copy_blocks([(1, 4), (3, 1)])
    moved = {4: 1, 1: 3}
    for layer, (k, v) in enumerate(cache[i] for i in range(len(cache))):
        k0, v0 = before[layer]
        for block in range(6):
            src = moved.get(block, block)
            assert torch.equal(k[block], k0[src]), (layer, block)
            assert torch.equal(v[block], v0[src]), (layer, block)


def test_copy_blocks_without_pairs_does_nothing():
    cache = filled(SPECS["uniform"])
    before = [t.clone() for t in cache.storage]
    cache.copy_blocks([])
    assert all(torch.equal(a, b) for a, b in zip(before, cache.storage, strict=True))
