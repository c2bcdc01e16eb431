"""Plain-data contracts between the engine's stages (scheduler -> runner -> engine).

Tests fake a stage by building one of these by hand. ``ScheduledChunk`` and ``ModelInput`` are
what crosses the process boundary to worker ranks, so they hold only what a rank needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.engine.sequence import Sequence


@dataclass
class SchedulerOutput:
    """What one engine step runs. Built by ``Scheduler.schedule``."""

    seqs: list[Sequence]  # scheduled sequences, running order (prefill chunks and decodes mixed)
    num_new_tokens: list[int]  # per seq: tokens whose KV this step computes (1 for a decode)
    preempted: list[Sequence] = field(default_factory=list)  # sent back to waiting this step

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def model_input(self) -> tuple[ModelInput, list[Sequence]]:
        """The runner's view of this step, and the sequences it samples (in row order).

        A chunk samples when it reaches the end of its sequence's known tokens."""
        chunks, sampled = [], []
        for seq, n in zip(self.seqs, self.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            sample = start + n == len(seq)
            tokens = seq.token_ids[start : start + n]
            chunks.append(ScheduledChunk(seq.seq_id, tokens, start, seq.block_table, sample))
            if sample:
                sampled.append(seq)
        return ModelInput(chunks), sampled


@dataclass
class ScheduledChunk:
    """One sequence's share of a step, as the ModelRunner sees it."""

    seq_id: int
    token_ids: list[int]  # tokens to compute: seq.token_ids[start_pos : start_pos + len]
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: bool  # the chunk ends the sequence's known tokens: sample the next one


@dataclass
class ModelInput:
    """One forward pass: every rank gets the same ModelInput."""

    chunks: list[ScheduledChunk]

    @property
    def is_decode(self) -> bool:
        """Every chunk is one token that is sampled (CUDA-graph eligible)."""
        return all(len(c.token_ids) == 1 and c.sample for c in self.chunks)


@dataclass
class RunnerOutput:
    """Rank 0's result of one step, one row per chunk with ``sample=True`` (in chunk order)."""

    sampled_token_ids: list[int]
    # per sampled row, when any request asked for logprobs: (sampled logprob, {id: logprob} top-k)
    logprobs: list[tuple[float, dict[int, float]] | None] | None = None
    # per sampled row: raw logits [V] (float32, on the device) when a request asked for them
    logits: list | None = None


@dataclass
class CompletionOutput:
    """One completion of a request (a request with ``n`` > 1 has n of these)."""

    index: int
    token_ids: list[int]  # generated ids, including the stop token when it ended on one
    text: str | None  # detokenized ``token_ids`` (None without a tokenizer)
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[tuple[float, dict[int, float]]] | None = None  # per token, when asked


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in input order."""

    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    # the first completion's fields, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs
