"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed chunk by chunk during prefill.

Row ``p`` of a prompt's forward pass (the hidden state at position ``p``) scores prompt token
``p + 1``. The engine side (``PromptLogprobState``) tells each prefill chunk which of its rows to
score and collects the results by position; the runner side (``score_prompt_rows``) turns those
rows' hidden states into logits a slice at a time and keeps only the target token's logprob, its
rank and the top k (``kernels/token_scores.py``: one pass over each row in the model's dtype on
CUDA, ``log_softmax`` in fp32 elsewhere): a ``[T, V]`` tensor for a whole prompt is never built.
The step's results stay on the device in one packed tensor (``PromptScores``) until ``entries``
copies them to the host at once; overlapped stepping starts that copy at launch and
reads it when the step's tokens are resolved, so a chunk's rows count as taken when planned
(``rows_for``), before their scores arrive (``record``).

Prefix caching: a scored row needs its own forward pass, so a request's sequence may take cached
blocks only for tokens before its first row still to be scored (``Sequence.max_cached_tokens``).
With ``prompt_logprobs_start = s`` the tokens before row ``s - 1`` are shared through the prefix
cache like any other prompt's; the default ``s = 1`` scores every token and so recomputes the
whole prompt. After a preemption, rows already scored are not scored again (no duplicates).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.engine.outputs import PromptLogprob, PromptRows, ScheduledChunk
from hf_paged.kernels import token_scores


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


def _on_device(values: list[list[int]], device: torch.device) -> torch.Tensor:
    """An int64 tensor on ``device`` without waiting for the stream: a blocking copy would
    wait for the step still running on the GPU and undo overlapped stepping."""
    t = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def _row_plan(chunks: list[ScheduledChunk], cu_seqlens: list[int]):
    """(hidden-row indices, target ids, (seq_id, num_rows, k) per chunk with rows)."""
    rows, targets, owners = [], [], []
    for i, c in enumerate(chunks):
        pr = c.prompt_rows
        if pr is None or not pr.target_ids:
            continue
        base = cu_seqlens[i] + pr.first
        rows.extend(range(base, base + len(pr.target_ids)))
        targets.extend(pr.target_ids)
        owners.append((c.seq_id, len(pr.target_ids), pr.k))
    return rows, targets, owners


def rows_per_slice(device: torch.device) -> int:
    """Scored rows turned into logits at once. The kernel keeps only the ``[rows, V]`` logits
    of the slice (bf16: ~0.3 GB at 1,024 rows and V = 152k); the reference also makes fp32
    temporaries of that shape, so it takes half as many."""
    return 1024 if token_scores.enabled(device) else 512


class PromptScores:
    """One step's prompt-logprob results, packed on the device: ``packed`` [R, 2 + 2k] fp32 =
    (logprob, rank, top-k logprobs, top-k ids) per scored row (ranks and ids < 2**24 are exact
    in fp32). ``copy_to_host`` starts the one device-to-host copy; ``entries`` waits for it."""

    def __init__(self, packed: torch.Tensor, targets: list[int], owners: list[tuple]):
        self.packed = packed
        self.targets = targets  # [R] the scored tokens
        self.owners = owners  # (seq_id, num_rows, k) per chunk with rows, in row order
        self.host, self.event = packed, None

    def copy_to_host(self) -> PromptScores:
        if self.packed.is_cuda:
            self.host = torch.empty(self.packed.shape, dtype=self.packed.dtype, pin_memory=True)
            self.host.copy_(self.packed, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        return self

    def entries(self) -> dict[int, list[PromptLogprob]]:
        """seq_id -> one PromptLogprob per scored row of its chunk (columns converted at once,
        one object per row)."""
        if self.event is not None:
            self.event.synchronize()
        host = self.host  # [R, 2 + 2k]
        k = (host.shape[1] - 2) // 2
        logprobs = host[:, 0].tolist()
        ranks = host[:, 1].long().tolist()
        top_v = host[:, 2 : 2 + k].tolist() if k else None  # [R][k]
        top_i = host[:, 2 + k :].long().tolist() if k else None
        out: dict[int, list[PromptLogprob]] = {}
        r = 0
        for seq_id, n, seq_k in self.owners:
            rows = zip(self.targets[r : r + n], logprobs[r : r + n], ranks[r : r + n])
            if seq_k == 0:
                out[seq_id] = [PromptLogprob(t, lp, rank, {}) for t, lp, rank in rows]
            else:  # the request's own seq_k alternatives of the step's k
                tops = zip(top_i[r : r + n], top_v[r : r + n])
                out[seq_id] = [
                    PromptLogprob(t, lp, rank, dict(zip(ids[:seq_k], vals[:seq_k])))
                    for (t, lp, rank), (ids, vals) in zip(rows, tops)
                ]
            r += n
        return out


def score_prompt_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor | None],
    hidden: torch.Tensor,
    chunks: list[ScheduledChunk],
    cu_seqlens: list[int],
) -> PromptScores | None:
    """Score every chunk's ``prompt_rows`` from the step's hidden states, on the device.

    Args:
        compute_logits: the model's ``compute_logits`` ([N, H] -> [N, V] on rank 0, None on other
            ranks). Every rank calls it with the same rows: under tensor parallelism it gathers.
        hidden: [T, H] hidden states of the step (rows in chunk order).
        chunks: the step's chunks; ``cu_seqlens[i]`` is chunk i's first row.

    Returns:
        The packed scores on rank 0 (``PromptScores.entries()`` gives seq_id -> one PromptLogprob
        per scored row); None when no chunk has rows, or on other ranks.
    """
    rows, targets, owners = _row_plan(chunks, cu_seqlens)
    if not rows:
        return None
    k = max(o[2] for o in owners)
    plan = _on_device([rows, targets], hidden.device)  # [2, R]: hidden rows, target ids
    step = rows_per_slice(hidden.device)
    packed = None  # [R, 2 + 2k] fp32, on rank 0
    for a in range(0, len(rows), step):
        logits = compute_logits(hidden[plan[0, a : a + step]])  # [r, V] or None
        if logits is None:
            continue
        if packed is None:
            packed = torch.empty(len(rows), 2 + 2 * k, dtype=torch.float32, device=logits.device)
        token_scores.token_scores(logits, plan[1, a : a + step], k, packed[a : a + step])
    return None if packed is None else PromptScores(packed, targets, owners)
