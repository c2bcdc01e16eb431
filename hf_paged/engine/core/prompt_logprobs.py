"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the engine's side, computed chunk by
chunk during prefill.

Row ``p`` of a prompt's forward pass (the hidden state at position ``p``) scores prompt token
``p + 1``. ``PromptLogprobState`` tells each prefill chunk which of its rows to score and collects
the results by position; the runner's side (``worker/prompt_scores.py``) scores those rows. A
chunk's rows count as taken when planned (``rows_for``), before their scores arrive (``record``):
overlapped stepping reads them a step later.

Prefix caching: a scored row needs its own forward pass, so a request's sequence may take cached
blocks only for tokens before its first row still to be scored (``Sequence.max_cached_tokens``).
With ``prompt_logprobs_start = s`` the tokens before row ``s - 1`` are shared through the prefix
cache like any other prompt's; the default ``s = 1`` scores every token and so recomputes the
whole prompt. After a preemption, rows already scored are not scored again (no duplicates).
"""

from __future__ import annotations

from hf_paged.engine.core.contracts import PromptRows, ScheduledChunk
from hf_paged.engine.core.outputs import PromptLogprob


class PromptLogprobState:
    """One request's prompt logprobs so far, and the next row still to score.

    Rows ``first_row .. len(prompt) - 2`` are scored; ``entries[p]`` is position p's score
    (``entries[0]`` and those before ``prompt_logprobs_start`` stay None). ``next_row`` is the
    first row no scheduled chunk has taken yet.
    """

    def __init__(self, prompt_token_ids: list[int], k: int, start: int):
        n = len(prompt_token_ids)
        self.prompt_token_ids = prompt_token_ids
        self.k = k
        self.next_row = min(start, n) - 1  # rows before it are scored or not wanted
        self.end_row = n - 1  # row n - 1 scores the first generated token: not a prompt token
        self.entries: list[PromptLogprob | None] = [None] * n

    @property
    def done(self) -> bool:
        return self.next_row >= self.end_row

    @property
    def max_cached_tokens(self) -> int | None:
        """How many leading tokens may come from the prefix cache (None: no limit)."""
        return None if self.done else self.next_row

    def rows_for(self, start: int, num_tokens: int) -> PromptRows | None:
        """The rows to score in a chunk computing positions ``[start, start + num_tokens)``;
        they are taken (a later chunk, after a preemption too, does not score them again)."""
        if self.done:
            return None
        if start > self.next_row:
            raise RuntimeError(
                f"prompt logprobs: a chunk starts at {start} but row {self.next_row} is not "
                "scored yet (its KV came from the prefix cache)"
            )
        first = max(start, self.next_row)
        last = min(start + num_tokens, self.end_row)  # exclusive
        if first >= last:
            return None
        targets = self.prompt_token_ids[first + 1 : last + 1]
        self.next_row = last
        return PromptRows(first - start, targets, self.k)

    def record(self, chunk: ScheduledChunk, scores: list[PromptLogprob]) -> None:
        """Store the scores of ``chunk.prompt_rows`` (one per row, in order)."""
        first = chunk.start_pos + chunk.prompt_rows.first
        n = len(chunk.prompt_rows.target_ids)
        if len(scores) != n or self.entries[first + 1 : first + 1 + n].count(None) != n:
            raise RuntimeError(
                f"prompt logprobs: got {len(scores)} rows from row {first}, expected {n} rows "
                "not scored before"
            )
        self.entries[first + 1 : first + 1 + n] = scores
