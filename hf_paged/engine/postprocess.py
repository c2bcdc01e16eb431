"""The engine's postprocess: the stop rule applied to what a step appended, the one place a
sequence stops (nano-vllm's ``Scheduler.postprocess``, vLLM's ``update_from_output``).

Plain Python on the engine's request table, scheduler and block manager; ``release`` lets the
speculative decoder drop what it keeps for a sequence that ends.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.contracts import TakenTokens
from hf_paged.engine.core.request_state import RequestTable
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence


class Postprocessor:
    """Takes a step's tokens (``take``) and ends sequences (``finish``) for one engine."""

    def __init__(self, requests: RequestTable, scheduler: Scheduler, block_manager: BlockManager,
                 max_model_len: int, release: Callable[[Sequence], None]):  # fmt: skip
        self.requests = requests
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.release = release  # a sequence that ends: the speculative decoder forgets it

    def take(self, taken: list[TakenTokens]) -> None:
        """The stop rule on a step's tokens, where the engine takes them (``TakenTokens``): each
        token in order until one ends its sequence; the tokens after it are dropped. Logprobs
        are recorded up to the stop. A sequence already ended while its last token was on the
        device (a length limit at launch, or an abort) is reported now, and a stop token among
        its tokens makes its reason "stop", as the synchronous path reports it."""
        max_len = self.max_model_len
        for t in taken:
            seq, req = t.seq, self.requests.of(t.seq.seq_id)
            if t.kind == "resolved" and not seq.is_finished:
                self.block_manager.cache_full_blocks(seq)  # its tokens are final now
            record = t.logprobs is not None and req.params.logprobs is not None
            reason, end = None, t.first
            for j, end in enumerate(range(t.first + 1, t.last + 1)):
                if record:
                    req.logprobs.setdefault(seq.seq_id, []).append(t.logprobs[j])
                reason = req.stop_reason(seq, end, max_len, known=t.kind != "launched")
                if reason is not None:
                    break
            if seq.is_finished:
                if reason == "stop":
                    del seq.token_ids[end:]  # drop tokens launched after the stop
                    if seq.finish_reason == "length":
                        seq.finish_reason = "stop"
                self.requests.mark_finished(seq)
            elif reason is not None:
                del seq.token_ids[end:]  # a placeholder's token arrives with its resolution
                self.finish(seq, reason)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (its request is reported once all its sequences are done)."""
        if not seq.is_finished:
            self.release(seq)
        self.scheduler.finish(seq, reason)
        self.requests.mark_finished(seq)

    def collect(self, ready, tokenizer) -> list:
        """The ``RequestOutput`` of each request whose last sequence finished (only those touched
        since last time); with overlapped stepping (``ready``: ``seq_id -> bool``), not before
        their last token reached the host."""
        return [req.output(tokenizer) for req in self.requests.take_done(ready)]
