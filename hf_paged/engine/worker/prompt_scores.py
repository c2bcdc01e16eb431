"""Prompt logprobs, the runner's side: score the rows that ``core/prompt_logprobs.py`` planned.

``score_prompt_rows`` turns the scored rows' hidden states into logits a slice at a time and keeps
only the target token's logprob, its rank and the top k (``kernels/token_scores.py``: one pass
over each row in the model's dtype on CUDA, ``log_softmax`` in fp32 elsewhere): a ``[T, V]``
tensor for a whole prompt is never built. The step's results stay on the device in one
packed tensor (``PromptScores``) until ``entries`` copies them to the host at once; overlapped
stepping starts that copy at launch and reads it when the step's tokens are resolved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.engine.core.contracts import ScheduledChunk
from hf_paged.engine.core.outputs import PromptLogprob
from hf_paged.kernels import token_scores


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
            k = min(k, logits.shape[-1])  # as the sampler's logprobs: at most the vocabulary
            packed = torch.empty(len(rows), 2 + 2 * k, dtype=torch.float32, device=logits.device)
        token_scores.token_scores(logits, plan[1, a : a + step], k, packed[a : a + step])
    return None if packed is None else PromptScores(packed, targets, owners)
