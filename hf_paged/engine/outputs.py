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
    # copy-on-write of forked blocks: (src_block, dst_block), applied before the forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # forks' recurrent states: (src_slot, dst_slot), applied before the forward
    states_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    def model_input(self) -> tuple[ModelInput, list[Sequence]]:
        """The runner's view of this step, and the sequences it samples (in row order).

        A chunk samples when it reaches the end of its sequence's known tokens; one that goes on
        through the sequence's speculative tokens has a logits row at each of its last
        ``1 + len(spec_token_ids)`` positions."""
        chunks, sampled = [], []
        for seq, n in zip(self.seqs, self.num_new_tokens, strict=True):
            start, spec = seq.num_computed_tokens, seq.spec_token_ids
            sample = start + n == len(seq) + len(spec)
            tokens = seq.token_ids[start : start + n]
            if spec and sample:
                tokens += spec
            chunk = ScheduledChunk(seq.seq_id, tokens, start, seq.block_table, sample,
                                   state_slot=seq.state_slot)  # fmt: skip
            if spec and sample:
                chunk.num_logits = 1 + len(spec)
            chunks.append(chunk)
            if sample:
                sampled.append(seq)
        return ModelInput(chunks, self.blocks_to_copy, self.states_to_copy), sampled


@dataclass
class PromptRows:
    """Rows of one chunk whose prompt logprobs are wanted (``SamplingParams.prompt_logprobs``).

    Row ``first + j`` of the chunk (position ``start_pos + first + j``) scores the prompt token
    ``target_ids[j]``, the token right after it.
    """

    first: int  # offset of the first scored row inside the chunk
    target_ids: list[int]  # the next prompt token of each scored row
    k: int  # top-k alternatives per row (0 = only the actual token)


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's score: its logprob given the tokens before it, and the top k.

    ``rank`` is 1 when the token is the argmax (ties broken like ``torch.argmax``: lowest id
    first), so ``rank == 1`` is lm-eval's ``is_greedy`` for that token.
    """

    token_id: int
    logprob: float  # log_softmax in fp32 of the model's logits
    rank: int  # 1 + how many ids come before it in (logprob desc, id asc) order
    top: dict[int, float]  # the k most likely ids -> logprob, most likely first

    def as_dict(self) -> dict[int, float]:
        """vLLM's shape: {token_id: logprob} with the actual token and the top k."""
        return {self.token_id: self.logprob, **self.top}


@dataclass
class ScheduledChunk:
    """One sequence's share of a step, as the ModelRunner sees it."""

    seq_id: int
    token_ids: list[int]  # tokens to compute: seq.token_ids[start_pos : start_pos + len]
    start_pos: int  # position of token_ids[0] == tokens already in the KV cache
    block_table: list[int]  # covers start_pos + len(token_ids) tokens
    sample: bool  # the chunk ends the sequence's known tokens: sample the next one
    prompt_rows: PromptRows | None = None  # rows whose prompt logprobs the runner returns
    # with ``sample``: logits rows at the chunk's last ``num_logits`` positions (1 + the
    # speculative tokens it verifies; each row scores the token after its position)
    num_logits: int = 1
    # recurrent models: the sequence's state-pool slot (0: none, or the dummy); its state
    # holds the tokens before ``start_pos`` when ``start_pos > 0``
    state_slot: int = 0


@dataclass
class ModelInput:
    """One forward pass: every rank gets the same ModelInput."""

    chunks: list[ScheduledChunk]
    # (src_block, dst_block): copy these blocks' K/V in every layer before the forward
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # (src_slot, dst_slot): copy these recurrent states before the forward (forks)
    states_to_copy: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """Every chunk is one token that is sampled (CUDA-graph eligible)."""
        return all(len(c.token_ids) == 1 and c.sample for c in self.chunks)

    @classmethod
    def synthetic_prefill(cls, lens: list[int], blocks_per_seq: int) -> ModelInput:
        """Whole prompts of ``lens`` tokens (the runner's warm-up); sequence i owns blocks
        [i * blocks_per_seq, (i + 1) * blocks_per_seq)."""
        k = blocks_per_seq
        return cls(
            [ScheduledChunk(i, [0] * n, 0, list(range(i * k, (i + 1) * k)), True)
             for i, n in enumerate(lens)]
        )  # fmt: skip


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
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (and
    # for those before ``prompt_logprobs_start``); None when not asked
    prompt_logprobs: list[PromptLogprob | None] | None = None

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
