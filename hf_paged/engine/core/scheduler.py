"""Continuous batching: which sequences run in the next step, and how many tokens each. No torch.

Each step mixes decodes and prefill chunks under two budgets (``max_num_batched_tokens`` tokens,
``max_num_seqs`` sequences) and the KV blocks the ``BlockManager`` can hand out. Running sequences
go first; when one cannot get a block, the newest running sequence is preempted (its blocks freed,
all its tokens recomputed later). Waiting sequences are admitted first come, first served, except
that one whose leading blocks a running sequence is still prefilling waits for them to reach the
prefix cache instead of computing them a second time (n > 1 samples of one prompt, lm-eval's
continuations of one context, any callers' shared system prompts). A running sequence with
speculative tokens (``Sequence.spec_token_ids``) gets them in the same chunk as its last token when
the budget and the KV allow, else it decodes plainly; ``accept`` keeps what the model verified.
A prefill chunk never ends inside one of its sequence's bidirectional ranges (an image whose
tokens attend to each other both ways, ``Sequence.bidirectional_ranges``): it stops before the
range, or takes all of it in one chunk even past the token budget, so a step exceeds
``max_num_batched_tokens`` by less than one range.
With LoRA adapters (``Sequence.lora_key``) at most ``max_loras`` distinct adapters run at once (the
runner's device slots): a waiting sequence of another adapter waits, and later waiting sequences
of adapters already running may pass it.
"""

from __future__ import annotations

from collections import deque

from hf_paged.engine.core.block_manager import BlockManager, block_key_tokens
from hf_paged.engine.core.contracts import SchedulerOutput
from hf_paged.engine.core.sequence import Sequence, SequenceStatus


def _same_embeds(a: Sequence, b: Sequence, num_blocks: int, bs: int) -> bool:
    """The first ``num_blocks`` blocks of ``a`` and ``b`` hold the same prompt embeddings (their
    prefix-cache keys agree beyond the token ids)."""
    if a.prompt_embeds is None and b.prompt_embeds is None:
        return True
    return all(block_key_tokens(a, i, bs) == block_key_tokens(b, i, bs) for i in range(num_blocks))


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
        max_loras: int | None = None,
    ):
        self.block_manager = block_manager
        self.max_loras = max_loras  # distinct LoRA adapters running at once (None: no adapters)
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
        ``num_new_tokens`` is at most ``max_num_batched_tokens`` (plus, when the last chunk takes a
        whole bidirectional range, less than that range's length) and at most ``max_num_seqs``
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
            if seq.bidirectional_ranges:
                num_new = whole_ranges(seq.bidirectional_ranges, seq.num_computed_tokens, num_new)
            if num_new < 1:
                raise RuntimeError(f"running {seq!r} has no token to compute (update missed?)")
            if seq.spec_token_ids:
                num_new = self._with_spec_tokens(seq, num_new, token_budget)
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
        loras = {s.lora_key for s in self.running if s.lora_key is not None}
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
            lora = seq.lora_key
            if (lora is not None and self.max_loras is not None and lora not in loras
                    and len(loras) >= self.max_loras):  # fmt: skip
                k += 1  # every adapter slot is taken by running sequences
                continue
            computed_blocks, num_cached = bm.get_computed_blocks(seq)
            num_new = min(len(seq) - num_cached, token_budget)
            if seq.bidirectional_ranges:
                num_new = whole_ranges(seq.bidirectional_ranges, num_cached, num_new)
            if not bm.allocate_slots(seq, num_new, computed_blocks):
                break
            del self.waiting[k]
            if lora is not None:
                loras.add(lora)
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
        out.states_to_copy = bm.take_state_copies()
        return out

    def _with_spec_tokens(self, seq: Sequence, num_new: int, token_budget: int) -> int:
        """``num_new`` plus the speculative tokens that fit the budget and the KV now (the rest
        are dropped: a proposal is worth less than a preemption)."""
        if num_new < seq.num_uncomputed_tokens:
            seq.spec_token_ids = []  # only a chunk that ends the known tokens verifies them
            return num_new
        spec = seq.spec_token_ids
        del spec[max(0, token_budget - num_new) :]
        if spec and not self.block_manager.allocate_slots(seq, num_new + len(spec)):
            spec.clear()
        return num_new + len(spec)

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
            if (
                end <= min(limit, other.num_prompt_tokens)
                and (seq.token_ids[:end] == other.token_ids[:end])
                and _same_embeds(seq, other, end // bs, bs)
                and other.lora_key == seq.lora_key
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
                the end of its known tokens, or, for a chunk that verified speculative tokens,
                the list of tokens it accepted (see ``accept``). Sequences finished since
                ``schedule`` are skipped.
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
            if isinstance(token_id, list):
                self.accept(seq, num_new, token_id, cache_blocks)
                continue
            if seq.spec_token_ids:
                raise ValueError(f"{seq!r} computed speculative tokens: pass the accepted list")
            seq.num_computed_tokens += num_new
            if cache_blocks:
                self.block_manager.cache_full_blocks(seq)
            if token_id is not None:
                if seq.num_computed_tokens != len(seq):
                    raise ValueError(f"token sampled for {seq!r} before its prefill ended")
                seq.append_token(token_id)

    def accept(
        self, seq: Sequence, num_new: int, tokens: list[int], cache_blocks: bool = True
    ) -> None:
        """Advance ``seq`` after a step that computed ``num_new`` tokens ending with its
        speculative ones: ``tokens`` are the accepted speculative tokens (a prefix of
        ``seq.spec_token_ids``) followed by the model's own next token.

        The rejected tokens' KV is rolled back (their blocks released, ``num_computed_tokens``
        rewound) before any full block is registered in the prefix cache, so no cached block
        holds a rejected token.

        Raises:
            ValueError: ``tokens`` is empty or not a prefix of the speculative tokens plus one.
        """
        spec, m = seq.spec_token_ids, len(tokens) - 1
        if m < 0 or m > len(spec) or tokens[:m] != spec[:m]:
            raise ValueError(
                f"tokens={tokens} is not allowed for {seq!r}: must be a prefix of its speculative "
                f"tokens {spec} followed by one more token"
            )
        seq.num_computed_tokens += num_new - (len(spec) - m)
        seq.token_ids.extend(tokens[:m])
        seq.spec_token_ids = []
        if seq.num_computed_tokens != len(seq):
            raise ValueError(f"speculative tokens verified for {seq!r} before its prefill ended")
        kept = self.block_manager.rollback(seq, seq.num_computed_tokens)
        seq.num_computed_tokens = kept
        seq.num_cached_tokens = min(seq.num_cached_tokens, kept)
        if cache_blocks:
            self.block_manager.cache_full_blocks(seq)
        seq.append_token(tokens[-1])

    def rollback(self, seq: Sequence, num_tokens: int, num_computed: int | None = None) -> None:
        """Cut ``seq`` to its first ``num_tokens`` tokens (at least its prompt): later tokens,
        speculative ones and their KV are dropped (``BlockManager.rollback``), and at most
        ``num_computed`` (default ``num_tokens``) tokens keep their KV; tokens the caller
        appends afterwards are computed by later steps.

        Raises:
            ValueError: ``num_tokens`` is outside ``[num_prompt_tokens, len(seq)]``.
        """
        if not seq.num_prompt_tokens <= num_tokens <= len(seq):
            raise ValueError(
                f"num_tokens={num_tokens} is not allowed for {seq!r}: must be in "
                f"[{seq.num_prompt_tokens}, {len(seq)}]"
            )
        del seq.token_ids[num_tokens:]
        seq.spec_token_ids = []
        limit = num_tokens if num_computed is None else min(num_computed, num_tokens)
        if seq.block_table:
            kept = self.block_manager.rollback(seq, min(seq.num_computed_tokens, limit))
            seq.num_computed_tokens = kept
            seq.num_cached_tokens = min(seq.num_cached_tokens, kept)

    def pause(self, seq: Sequence) -> None:
        """Take running ``seq`` out of the schedule; it keeps its blocks (an external request
        waiting for its caller's token)."""
        self.running.remove(seq)

    def resume(self, seq: Sequence) -> None:
        """Schedule a paused ``seq`` again: running, or waiting when its blocks were freed
        meanwhile (``reset_for_recompute``)."""
        if seq.status == SequenceStatus.WAITING:
            self.add(seq)
        else:
            self.running.append(seq)

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


def whole_ranges(ranges: list[tuple[int, int]], start: int, num_new: int) -> int:
    """``num_new`` moved so that the chunk ``[start, start + num_new)`` ends outside every range
    of ``ranges`` (sorted half-open ``(a, b)``): a chunk that would cut a range after its own
    start stops before it (its tokens go whole into a later chunk); one that starts at or inside
    a range runs to the range's end, past the budget if it must, so every step makes progress.
    """
    end = start + num_new
    for a, b in ranges:
        if a < end < b:
            return a - start if a > start else b - start
        if a >= end:
            break
    return num_new
