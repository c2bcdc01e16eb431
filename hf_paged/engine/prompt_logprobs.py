"""Prompt logprobs (``SamplingParams.prompt_logprobs``), computed chunk by chunk during prefill.

Row ``p`` of a prompt's forward pass (the hidden state at position ``p``) scores prompt token
``p + 1``. The engine side (``PromptLogprobState``) tells each prefill chunk which of its rows to
score and collects the results by position; the runner side (``score_prompt_rows``) turns those
rows' hidden states into logits a slice at a time, takes ``log_softmax`` in fp32 and keeps only
the target token's logprob, its rank and the top k: a ``[T, V]`` tensor for a whole prompt is
never built. The step's results stay on the device in one packed tensor (``PromptScores``) until
``entries`` copies them to the host at once; overlapped stepping starts that copy at launch and
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

# rows turned into logits at once: bounds the [rows, V] fp32 temporaries (~300 MB at V = 152k)
MAX_ROWS_PER_SLICE = 512


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
        if len(scores) != n or any(e is not None for e in self.entries[first + 1 : first + 1 + n]):
            raise RuntimeError(
                f"prompt logprobs: got {len(scores)} rows from row {first}, expected {n} rows "
                "not scored before"
            )
        self.entries[first + 1 : first + 1 + n] = scores


def _on_device(values: list[int], device: torch.device) -> torch.Tensor:
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


@torch.inference_mode()
def _score_slice(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """[r, V] logits, [r] targets -> logprob [r], rank [r], top-k values/ids [r, k] (fp32)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
    tgt = lp.gather(1, targets[:, None])  # [r, 1]
    ids = torch.arange(lp.shape[1], device=lp.device)
    before = (lp > tgt) | ((lp == tgt) & (ids[None, :] < targets[:, None]))
    rank = 1 + before.sum(dim=1)  # [r]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
    return tgt[:, 0], rank, top_v, top_i


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
        """seq_id -> one PromptLogprob per scored row of its chunk."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.host.tolist()  # [R][2 + 2k]
        k = (self.host.shape[1] - 2) // 2
        out: dict[int, list[PromptLogprob]] = {}
        r = 0
        for seq_id, n, seq_k in self.owners:
            out[seq_id] = [_entry(self.targets[j], rows[j], k, seq_k) for j in range(r, r + n)]
            r += n
        return out


def _entry(target: int, row: list[float], k: int, seq_k: int) -> PromptLogprob:
    """One packed row (logprob, rank, k top logprobs, k top ids) -> PromptLogprob with the
    request's own ``seq_k`` alternatives."""
    top = {int(i): v for i, v in zip(row[2 + k : 2 + k + seq_k], row[2 : 2 + seq_k])}
    return PromptLogprob(target, row[0], int(row[1]), top)


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
    idx = _on_device(rows, hidden.device)  # [R]
    tgt = _on_device(targets, hidden.device)  # [R]
    parts = []
    for a in range(0, len(rows), MAX_ROWS_PER_SLICE):
        logits = compute_logits(hidden[idx[a : a + MAX_ROWS_PER_SLICE]])  # [r, V] or None
        if logits is not None:
            lp, rank, top_v, top_i = _score_slice(logits, tgt[a : a + MAX_ROWS_PER_SLICE], k)
            parts.append(torch.cat([lp[:, None], rank[:, None].float(), top_v,
                                    top_i.float()], dim=1))  # fmt: skip
    if not parts:
        return None
    return PromptScores(torch.cat(parts), targets, owners)
