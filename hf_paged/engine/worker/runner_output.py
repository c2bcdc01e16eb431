"""What a runner step hands back to the engine: ``RunnerOutput`` (a synchronous step, on the
host but for the raw logits rows, which stay on the device) and ``PendingTokens`` (an overlapped
step's sampled tokens, still on the device)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.engine.core.outputs import PromptLogprob
from hf_paged.engine.worker.prompt_scores import PromptScores


@dataclass
class RunnerOutput:
    """Rank 0's result of one step: one row per logits row, in chunk order (a chunk with
    ``sample=True`` has ``num_logits`` rows, its positions' order)."""

    sampled_token_ids: list[int]
    # per sampled row, when any request asked for logprobs: (sampled logprob, {id: logprob} top-k)
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # per sampled row: raw logits [V] (float32, on the device) when a request asked for them
    logits: list | None = None
    # seq_id -> one PromptLogprob per row of its chunk's ``prompt_rows``, when a chunk has them
    prompt_logprobs: dict[int, list[PromptLogprob]] | None = None


class PendingTokens:
    """Sampled token ids still on the device; ``wait`` brings them to the host. On CUDA the
    copy to pinned memory starts at once and an event marks its end. ``prompt_scores``: the
    step's prompt logprobs (``PromptScores``, their copy started too), or None."""

    def __init__(self, tokens: torch.Tensor, prompt_scores: PromptScores | None = None):
        self.tokens = tokens  # [B] int64 on the device (next step's inputs are gathered here)
        self.prompt_scores = prompt_scores.copy_to_host() if prompt_scores is not None else None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = tokens, None

    def wait(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
