"""EncoderCache: image features by hash, bounded in rows, least recently used evicted first."""

from __future__ import annotations

from dataclasses import dataclass

from hf_paged.engine.core.encoder_cache import EncoderCache


@dataclass
class Feats:
    num_rows: int


def test_hits_misses_and_lru_eviction_order():
    cache = EncoderCache(budget_rows=10)
    assert cache.get("a") is None
    cache.put("a", Feats(4))
    cache.put("b", Feats(4))
    assert cache.get("a").num_rows == 4  # a is now the most recently used
    cache.put("c", Feats(4))  # 12 > 10: b (least recently used) goes
    assert "b" not in cache and "a" in cache and "c" in cache
    assert cache.num_rows == 8 and cache.num_evicted == 1
    cache.put("d", Feats(6))  # 14 > 10: a goes; c and d fit
    assert "a" not in cache and "c" in cache and "d" in cache and cache.num_rows == 10
    stats = cache.stats()
    assert stats["encoder_cache_hits"] == 1 and stats["encoder_cache_misses"] == 1
    assert stats["encoder_cache_encoded_images"] == 4 and stats["encoder_cache_evicted"] == 2
    assert stats["encoder_cache_budget_rows"] == 10 and stats["encoder_cache_rows"] == 10


def test_an_image_larger_than_the_budget_is_not_kept():
    cache = EncoderCache(budget_rows=5)
    cache.put("a", Feats(3))
    cache.put("big", Feats(6))
    assert "big" not in cache and "a" in cache and cache.num_rows == 3


def test_zero_budget_keeps_nothing():
    cache = EncoderCache(budget_rows=0)
    cache.put("a", Feats(1))
    assert len(cache) == 0 and cache.get("a") is None
