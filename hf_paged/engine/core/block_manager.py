"""KV-cache blocks: allocation, reference counts and the prefix cache. No torch.

A block holds ``block_size`` consecutive tokens of one or more sequences (shared prefixes). Each
block is in exactly one of three states:

- free: ref count 0 and not in the prefix cache; handed out first, lowest ids first;
- cached: ref count 0 but registered in the prefix cache (evictable, least recently freed first);
- in use: ref count > 0 (never evicted or handed out).

The prefix cache maps a chained hash ``hash_block(parent_hash, block_tokens)`` to a block id. A
block's tokens in its key are its ids plus each bidirectional range overlapping it. A
block is registered once it is full and its KV computed, so a later sequence with the same leading
tokens can take it instead of recomputing it (vLLM v1's ``KVCacheManager``, simplified).

Forks (beam search): ``fork`` gives a new sequence every block of another, one more reference
each. Before a sequence writes into a block another sequence also holds (the shared, partially
filled last block of a fork), ``allocate_slots`` gives it a fresh block instead and records
``(src_block, dst_block)``; the runner copies those blocks' K/V in every layer before the step's
forward (``take_copies`` hands the step's list to the scheduler). Only blocks at or past
``num_computed_tokens`` are ever written, and those are never registered in the prefix cache,
so a copied block has no hash to move: a full block's hash is the same whichever fork holds it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence as SequenceLike

from hf_paged.engine.core.prompt_embeds import block_extra_keys
from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.core.state_slots import StateSlots

# (parent block hash, or for a first block the sequence's LoRA key or None; the block's tokens)
BlockKey = tuple[int | str | None, tuple[int, ...]]


def block_key_tokens(seq: Sequence, i: int, bs: int) -> tuple:
    """What block ``i`` of ``seq`` holds, as its prefix-cache key sees it: its token ids, then
    ``("embeds", key, offset)`` for each prompt-embedding range overlapping it (an image's hash
    and where it starts relative to the block; ``core/prompt_embeds.py``), then for each of the
    sequence's bidirectional ranges overlapping it, where the range lies relative to the block
    and all its ids (a token inside a range attends to the range's later tokens too, so its KV
    depends on ids past its own block)."""
    lo, hi = i * bs, (i + 1) * bs
    tokens = tuple(seq.token_ids[lo:hi])
    bidirectional = tuple(("bidirectional", a - lo, b - lo, tuple(seq.token_ids[a:b]))
                          for a, b in seq.bidirectional_ranges if a < hi and b > lo)  # fmt: skip
    return tokens + block_extra_keys(seq.prompt_embeds, lo, hi) + bidirectional


def hash_block(parent_hash: int | str | None, token_ids: tuple[int, ...]) -> int:
    """Chained hash of one full block: the hash of the blocks before it and its own tokens.
    A first block chains from its sequence's ``lora_key`` (None: the base model), so every block
    of a chain is keyed by the adapter its KV was computed under."""
    return hash((parent_hash, token_ids))


class BlockManager:
    """Hands out KV blocks to sequences and shares identical full prefix blocks between them.

    Pure bookkeeping: it never touches the KV tensors. Not thread-safe (one engine thread).

    Attributes:
        num_blocks: blocks in the pool (ids ``0 .. num_blocks - 1``).
        block_size: tokens per block.
        enable_prefix_caching: register and reuse full blocks.
        ref_counts: per block, how many sequences hold it (read-only for callers).
        num_prefix_queries_tokens: tokens looked up in the prefix cache since ``reset_stats``.
        num_prefix_hit_tokens: of those, tokens found (whole blocks).
        num_copied_blocks: copy-on-write copies recorded since construction.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        num_state_slots: int = 0,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks!r} is not allowed: must be >= 1")
        if block_size < 1:
            raise ValueError(f"block_size={block_size!r} is not allowed: must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts: list[int] = [0] * num_blocks
        self._free_ids: deque[int] = deque(range(num_blocks))  # popleft to allocate
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._cached: dict[int, int] = {}  # block hash -> block id
        self._block_hash: list[int | None] = [None] * num_blocks  # set while registered
        self._block_key: list[BlockKey | None] = [None] * num_blocks  # for the collision check
        self._copies: dict[int, int] = {}  # dst block -> src block, recorded since take_copies
        self.num_copied_blocks = 0
        # recurrent models: a state slot per sequence holding blocks (``state_slots.py``)
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching is not allowed with recurrent state slots")
        self.state_slots = StateSlots(num_state_slots) if num_state_slots else None
        self._state_copies: list[tuple[int, int]] = []  # (src slot, dst slot) of forks
        self.reset_stats()

    # ---- queries -------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks obtainable now: free ones plus unreferenced cached (evictable) ones."""
        return len(self._free_ids) + len(self._evictable)

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hit tokens / queried tokens since ``reset_stats`` (0.0 before any query)."""
        q = self.num_prefix_queries_tokens
        return self.num_prefix_hit_tokens / q if q else 0.0

    def reset_stats(self) -> None:
        self.num_prefix_queries_tokens = 0
        self.num_prefix_hit_tokens = 0

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """The longest run of leading full blocks of ``seq`` already in the prefix cache.

        At most ``(len(seq) - 1) // block_size`` blocks are returned, so at least one token is
        left to compute (its logits give the next token), and none past
        ``seq.max_cached_tokens`` tokens when that is set. Takes no references: pass the ids to
        ``allocate_slots`` in the same step.

        A hit must match the stored ``(parent hash, tokens)`` exactly, so a collision of a
        block's own hash is a miss. Counts ``len(seq)`` queried tokens and the hit tokens.

        Returns:
            (block ids, number of tokens they hold == len(ids) * block_size); ``([], 0)`` when
            prefix caching is off.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        limit = len(seq) - 1
        if seq.max_cached_tokens is not None:
            limit = min(limit, seq.max_cached_tokens)
        max_hits = limit // bs
        ids: list[int] = []
        parent: int | str | None = seq.lora_key
        for i in range(max_hits):
            tokens = block_key_tokens(seq, i, bs)
            h = hash_block(parent, tokens)
            block_id = self._cached.get(h)
            if block_id is None or self._block_key[block_id] != (parent, tokens):
                break
            ids.append(block_id)
            parent = h
        self.num_prefix_queries_tokens += len(seq)
        self.num_prefix_hit_tokens += len(ids) * bs
        return ids, len(ids) * bs

    # ---- changes -------------------------------------------------------------------------

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: SequenceLike[int] = ()
    ) -> bool:
        """Grow ``seq.block_table`` to cover its computed tokens, the cached blocks and new ones.

        Covers ``seq.num_computed_tokens + len(computed_blocks) * block_size + num_new_tokens``
        tokens. ``computed_blocks`` (from ``get_computed_blocks``) go first, one reference each;
        new blocks come from the free list, then by evicting the least recently freed cached
        block (its prefix-cache entry is dropped). A block of ``seq`` the new tokens will be
        written into that another sequence also holds is replaced by a new one (copy on
        write: the copy is recorded for ``take_copies``).

        With state slots (a recurrent model), a sequence without one gets one too, or the call
        fails.

        Returns:
            True on success; False, with nothing changed, when not enough blocks (or no state
            slot) can be had.

        Raises:
            ValueError: ``computed_blocks`` given for a sequence that already has blocks.
        """
        slots = self.state_slots
        needs_slot = slots is not None and seq.state_slot == 0
        if needs_slot and slots.num_free == 0:
            return False
        if computed_blocks and seq.block_table:
            raise ValueError(
                f"computed_blocks={list(computed_blocks)} given for {seq!r}, which has blocks"
            )
        bs = self.block_size
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * bs + num_new_tokens
        num_needed = -(-num_tokens // bs) - len(seq.block_table) - len(computed_blocks)
        # blocks this step writes into (from the first uncomputed token on) that another
        # sequence also holds: copied on write (a fork's shared, partially filled last block)
        table = seq.block_table
        shared = [
            i
            for i in range(seq.num_computed_tokens // bs, len(table))
            if self.ref_counts[table[i]] > 1
        ]
        # cached blocks taken from the evictable LRU no longer count as obtainable
        num_revived = sum(1 for b in set(computed_blocks) if self.ref_counts[b] == 0)
        if num_needed + len(shared) > self.num_free_blocks - num_revived:
            return False
        if needs_slot:
            seq.state_slot = slots.alloc()
        for i in shared:
            src, dst = table[i], self._take_block()
            self.ref_counts[src] -= 1  # stays >= 1: another sequence holds it
            self.ref_counts[dst] = 1
            table[i] = dst
            self._copies[dst] = src  # a later copy into the same dst (it was freed) wins
            self.num_copied_blocks += 1
        for block_id in computed_blocks:
            if self.ref_counts[block_id] == 0:
                del self._evictable[block_id]
            self.ref_counts[block_id] += 1
            seq.block_table.append(block_id)
            seq.block_hashes.append(self._block_hash[block_id])
        for _ in range(num_needed):
            block_id = self._take_block()
            self.ref_counts[block_id] = 1
            seq.block_table.append(block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each full, computed, not yet hashed block of ``seq`` in the prefix cache.

        Block ``i`` qualifies when ``i < seq.num_computed_tokens // block_size``; its chained hash
        is appended to ``seq.block_hashes``. If another block already holds that hash, this one
        stays unregistered (it goes to the free list when released). No-op when caching is off.
        """
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        parent = seq.block_hashes[-1] if seq.block_hashes else seq.lora_key
        for i in range(len(seq.block_hashes), num_full):
            tokens = block_key_tokens(seq, i, bs)
            h = hash_block(parent, tokens)
            seq.block_hashes.append(h)
            block_id = seq.block_table[i]
            if h not in self._cached and self._block_hash[block_id] is None:
                self._cached[h] = block_id
                self._block_hash[block_id] = h
                self._block_key[block_id] = (parent, tokens)
            parent = h

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references, tail block first, and clear its block table and hashes.

        A block reaching ref count 0 becomes evictable (newest end of the LRU) if it is in the
        prefix cache, else free. Tail first means a sequence's tail is evicted before its head,
        which other sequences are likelier to share.
        """
        for block_id in reversed(seq.block_table):
            self._release(block_id)
        seq.block_table = []
        seq.block_hashes = []
        if self.state_slots is not None and seq.state_slot:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = 0

    def rollback(self, seq: Sequence, num_tokens: int) -> int:
        """Keep the KV of ``seq``'s first ``num_tokens`` tokens only (rejected speculative
        tokens, a rewritten tail): the blocks past them are released, tail first, and
        ``seq.block_hashes`` keeps the full blocks before them.

        The block the new end falls inside is written again later, so it must be ``seq``'s
        alone: when it is in the prefix cache or shared, it is released too and the tokens it
        held before the new end are to be recomputed (the return value is then its start).

        Returns:
            How many leading tokens keep their KV (``num_tokens`` or less); the caller sets
            ``seq.num_computed_tokens`` to it.

        Raises:
            ValueError: ``num_tokens`` is negative.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is not allowed: must be >= 0")
        if self.state_slots is not None and num_tokens < seq.num_computed_tokens:
            num_tokens = 0  # a recurrent state cannot be rolled back: recompute it all
        bs = self.block_size
        keep = min(-(-num_tokens // bs), len(seq.block_table))
        num_tokens = min(num_tokens, keep * bs)
        if num_tokens % bs:
            last = seq.block_table[keep - 1]
            if self._block_hash[last] is not None or self.ref_counts[last] > 1:
                keep -= 1
                num_tokens = keep * bs
        for block_id in reversed(seq.block_table[keep:]):
            self._release(block_id)
        del seq.block_table[keep:]
        del seq.block_hashes[num_tokens // bs :]
        return num_tokens

    def fork(self, src: Sequence, dst: Sequence) -> None:
        """``dst`` takes every block of ``src`` (one more reference each) and its block hashes.

        The blocks stay shared until one of the two writes into one (``allocate_slots`` copies
        it then). ``dst`` is typically ``src.fork()``.

        With state slots, ``dst`` gets a slot of its own and the copy of ``src``'s state is
        recorded for ``take_state_copies``.

        Raises:
            ValueError: ``dst`` already has blocks.
            RuntimeError: no state slot is free for ``dst``.
        """
        if dst.block_table:
            raise ValueError(f"fork into {dst!r} is not allowed: it already has blocks")
        if self.state_slots is not None and src.state_slot:
            dst.state_slot = self.state_slots.alloc()
            self._state_copies.append((src.state_slot, dst.state_slot))
        for block_id in src.block_table:
            self.ref_counts[block_id] += 1
        dst.block_table = list(src.block_table)
        dst.block_hashes = list(src.block_hashes)

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src_block, dst_block)`` copies recorded since the last call, one per dst. The
        runner applies them before the step's forward, every source read before any destination
        is written (a source block freed and handed out again in the same step still gives its
        old contents)."""
        copies, self._copies = [(s, d) for d, s in self._copies.items()], {}
        return copies

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The ``(src_slot, dst_slot)`` state copies of forks since the last call; applied as
        ``take_copies``' blocks (every source read before any destination is written)."""
        copies, self._state_copies = self._state_copies, []
        return copies

    def reset_prefix_cache(self) -> int:
        """Forget every cached block no sequence holds (they become free blocks); blocks in use
        stay cached. Returns how many were dropped."""
        n = len(self._evictable)
        while self._evictable:
            self._free_ids.append(self._evict_oldest())
        return n

    def _release(self, block_id: int) -> None:
        """One reference less; at 0 the block becomes evictable (cached) or free."""
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if self._block_hash[block_id] is not None:
                self._evictable[block_id] = None
            else:
                self._free_ids.append(block_id)

    def _take_block(self) -> int:
        """A block with ref count 0, from the free list or by evicting the oldest cached one."""
        if self._free_ids:
            return self._free_ids.popleft()
        return self._evict_oldest()

    def _evict_oldest(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash[block_id]]
        self._block_hash[block_id] = None
        self._block_key[block_id] = None
        return block_id
