"""Continuous batching: which sequences run in the next step, and how many tokens each. No torch.

Each step mixes decodes and prefill chunks under two budgets (``max_num_batched_tokens`` tokens,
``max_num_seqs`` sequences) and the KV blocks the ``BlockManager`` can hand out. Running sequences
go first; when one cannot get a block, the newest running sequence is preempted (its blocks freed,
all its tokens recomputed later). Waiting sequences are admitted first come, first served, except
that one whose leading blocks a running sequence is still prefilling waits for them to reach the
prefix cache instead of computing them a second time (n > 1 samples of one prompt, lm-eval's
continuations of one context, any callers' shared system prompts).
"""

from __future__ import annotations

from collections import deque

from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.outputs import SchedulerOutput
from hf_paged.engine.sequence import Sequence, SequenceStatus


class Scheduler:
    """Picks each step's prefill chunks and decodes; preempts by recompute when KV runs out.

    Attributes:
        waiting: sequences not running, ordered by ``arrival`` (preempted ones keep their place).
        running: sequences holding KV blocks, in admission order.
        num_preemptions: preemptions since construction.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.max_num_running_seqs = 0  # most sequences in ``running`` after any schedule()
        self.num_held_back = 0  # times a waiting sequence waited for a prefix being prefilled

    def add(self, seq: Sequence) -> None:
        """Queue ``seq`` (status WAITING) in ``waiting`` at its ``arrival`` place (new: the end).

        Raises:
            ValueError: the sequence is empty or longer than ``max_model_len``.
        """
        if not 0 < len(seq) <= self.max_model_len:
            raise ValueError(
                f"sequence of {len(seq)} tokens is not allowed: must be 1..{self.max_model_len} "
                "(max_model_len)"
            )
        seq.status = SequenceStatus.WAITING
        self._insert_waiting(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """The next step: running sequences first (preempting if KV runs out), then new ones.

        Every scheduled sequence appears once with ``num_new_tokens >= 1``; the sum of
        ``num_new_tokens`` is at most ``max_num_batched_tokens`` and at most ``max_num_seqs``
        sequences run. Waiting sequences are not admitted in a step that preempted.
        """
        out = SchedulerOutput(seqs=[], num_new_tokens=[])
        token_budget = self.max_num_batched_tokens
        bm = self.block_manager

        # 1. running: running[:i] are scheduled this step, running[i:] not yet
        i = 0
        while i < len(self.running) and token_budget > 0 and len(out.seqs) < self.max_num_seqs:
            seq = self.running[i]
            num_new = min(seq.num_uncomputed_tokens, token_budget)
            if num_new < 1:
                raise RuntimeError(f"running {seq!r} has no token to compute (update missed?)")
            while not bm.allocate_slots(seq, num_new):
                victim = max(self.running[i:], key=lambda s: s.arrival)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                token_budget -= num_new
                i += 1

        # 2. waiting, FCFS; stop at the first that does not fit. Only a sequence whose prefix a
        # running one is still prefilling is passed over (``_held_back``): it waits for the cache
        prefilling = self._prefilling_by_first_block() if self.waiting else {}
        k = 0
        while (
            not out.preempted
            and k < len(self.waiting)
            and token_budget > 0
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[k]
            if prefilling and self._held_back(seq, prefilling):
                k += 1
                self.num_held_back += 1
                continue
            computed_blocks, num_cached = bm.get_computed_blocks(seq)
            num_new = min(len(seq) - num_cached, token_budget)
            if not bm.allocate_slots(seq, num_new, computed_blocks):
                break
            del self.waiting[k]
            if prefilling is not None:
                self._add_prefilling(prefilling, seq)
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            token_budget -= num_new
        self.max_num_running_seqs = max(self.max_num_running_seqs, len(self.running))
        # a copy is recorded only for a sequence this step runs (allocation succeeded, and a
        # scheduled sequence is never a later victim), so an empty step drops none that matter
        out.blocks_to_copy = bm.take_copies()
        return out

    def _prefilling_by_first_block(self) -> dict | None:
        """Running sequences still computing prompt blocks, by their first block's tokens (None
        when prefix caching is off: nothing is worth waiting for)."""
        if not self.block_manager.enable_prefix_caching:
            return None
        found: dict[tuple[int, ...], list[Sequence]] = {}
        for seq in self.running:
            self._add_prefilling(found, seq)
        return found

    def _add_prefilling(self, found: dict, seq: Sequence) -> None:
        bs = self.block_manager.block_size
        if seq.num_computed_tokens < seq.num_prompt_tokens and seq.num_prompt_tokens > bs:
            found.setdefault(tuple(seq.token_ids[:bs]), []).append(seq)

    def _held_back(self, seq: Sequence, prefilling: dict) -> bool:
        """Whether ``seq`` should wait: a running sequence that has not yet registered its
        prompt block ``a`` (its first unregistered one) shares blocks ``0..a`` with ``seq``,
        and ``seq`` could take block ``a`` from the cache. Once that block is registered (the
        step computing it ended) the question moves on to the next block, so ``seq`` waits as
        long as, and only as long as, a running sequence is prefilling what it can reuse; a
        running sequence always makes progress (or is preempted and stops counting), so this
        cannot deadlock."""
        bs = self.block_manager.block_size
        limit = len(seq) - 1  # as get_computed_blocks: one token left to compute
        if seq.max_cached_tokens is not None:
            limit = min(limit, seq.max_cached_tokens)
        if limit < bs:
            return False
        for other in prefilling.get(tuple(seq.token_ids[:bs]), ()):
            end = (len(other.block_hashes) + 1) * bs  # through its first unregistered block
            if end <= min(limit, other.num_prompt_tokens) and (
                seq.token_ids[:end] == other.token_ids[:end]
            ):
                return True
        return False

    def update(
        self, out: SchedulerOutput, sampled: list[int | None], cache_blocks: bool = True
    ) -> None:
        """Advance the sequences of a finished step and append their sampled tokens.

        Args:
            out: what ``schedule`` returned for the step.
            sampled: per ``out.seqs[i]``, the sampled token, or None when its chunk did not reach
                the end of its known tokens. Sequences finished since ``schedule`` are skipped.
            cache_blocks: register newly full blocks in the prefix cache now; False when token
                values are still placeholders (overlapped stepping registers them later).

        Raises:
            ValueError: ``sampled`` has the wrong length, or a token for an unfinished chunk.
        """
        if len(sampled) != len(out.seqs):
            raise ValueError(f"got {len(sampled)} sampled tokens for {len(out.seqs)} sequences")
        for seq, num_new, token_id in zip(out.seqs, out.num_new_tokens, sampled, strict=True):
            if seq.is_finished:
                continue
            seq.num_computed_tokens += num_new
            if cache_blocks:
                self.block_manager.cache_full_blocks(seq)
            if token_id is not None:
                if seq.num_computed_tokens != len(seq):
                    raise ValueError(f"token sampled for {seq!r} before its prefill ended")
                seq.append_token(token_id)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark ``seq`` FINISHED with ``reason``, free its blocks, drop it from the queues.

        Safe wherever ``seq`` is: running, waiting, or held outside both by the engine. Finishing
        an already finished sequence does nothing (it keeps its first reason).
        """
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq)

    def _preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s KV and put it back in ``waiting`` at its arrival-order place."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.num_preemptions += 1
        self._insert_waiting(seq)

    def _insert_waiting(self, seq: Sequence) -> None:
        """Insert keeping ``waiting`` sorted by arrival (after equal ones); O(1) for new ones."""
        if not self.waiting or self.waiting[-1].arrival <= seq.arrival:
            self.waiting.append(seq)
            return
        pos = next(k for k, s in enumerate(self.waiting) if s.arrival > seq.arrival)
        self.waiting.insert(pos, seq)
