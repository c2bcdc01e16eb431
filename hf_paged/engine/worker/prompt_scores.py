"""Prompt logprobs, the runner's side: score the rows that ``core/prompt_logprobs.py`` planned.

``score_prompt_rows`` turns the scored rows' hidden states into logits a slice at a time, takes
``log_softmax`` in fp32 and keeps only the target token's logprob, its rank and the top k: a
``[T, V]`` tensor for a whole prompt is never built. The step's results stay on the device in one
packed tensor (``PromptScores``) until ``entries`` copies them to the host at once; overlapped
stepping starts that copy at launch and reads it when the step's tokens are resolved.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from hf_paged.engine.core.contracts import ScheduledChunk
from hf_paged.engine.core.outputs import PromptLogprob

# rows turned into logits at once: bounds the [rows, V] fp32 temporaries (~300 MB at V = 152k)
MAX_ROWS_PER_SLICE = 512


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
