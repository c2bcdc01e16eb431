"""The encoder cache: image features by content hash, bounded in embedding rows. No torch.

A vision-language model's vision tower and projector run stock, on the prefill side, once per
distinct image: the front end that encodes images (``integration/multimodal``) asks ``get`` for
each image of a call, encodes the misses in one batch, and ``put``s them. Rows, beams,
``num_return_sequences`` and later calls with the same image share one entry. The budget counts
embedding rows (an image of N placeholder tokens costs N); the least recently used entries go
first when a new one needs room. An entry larger than the whole budget is used once and not kept.
"""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    """Least-recently-used map of image hash -> its features (any value with ``num_rows``, such
    as ``models.vision.ImageFeatures``), at most ``budget_rows`` rows.

    Attributes:
        num_hits / num_misses: ``get`` lookups that found / did not find their image.
        num_encoded: images ``put`` (each is one image the vision tower ran on).
        num_evicted: entries dropped to make room.
    """

    def __init__(self, budget_rows: int):
        self.budget_rows = budget_rows
        self._entries: OrderedDict[object, object] = OrderedDict()
        self.num_rows = 0  # rows held now
        self.num_hits = self.num_misses = self.num_encoded = self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def get(self, key) -> object | None:
        """The features of the image hashed ``key`` (now the most recently used), or None."""
        out = self._entries.get(key)
        if out is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self._entries.move_to_end(key)
        return out

    def put(self, key, out: object) -> None:
        """Keep ``out`` for ``key``, evicting the least recently used entries to fit it."""
        self.num_encoded += 1
        if key in self._entries:
            self._drop(key)
        if out.num_rows > self.budget_rows:
            return
        while self.num_rows + out.num_rows > self.budget_rows:
            self._drop(next(iter(self._entries)))
            self.num_evicted += 1
        self._entries[key] = out
        self.num_rows += out.num_rows

    def clear(self) -> None:
        self._entries.clear()
        self.num_rows = 0

    def _drop(self, key) -> None:
        self.num_rows -= self._entries.pop(key).num_rows

    def stats(self) -> dict:
        """Counters for ``llm.stats`` (prefix ``encoder_cache_``)."""
        return {
            "encoder_cache_hits": self.num_hits,
            "encoder_cache_misses": self.num_misses,
            "encoder_cache_encoded_images": self.num_encoded,
            "encoder_cache_evicted": self.num_evicted,
            "encoder_cache_rows": self.num_rows,
            "encoder_cache_budget_rows": self.budget_rows,
        }
