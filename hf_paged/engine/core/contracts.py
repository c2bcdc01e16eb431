"""Plain-data contracts from the scheduler to the runner (what one step runs), and from the
steppers back to the engine (``TakenTokens``: what a step appended, for the stop rule).

Tests fake a stage by building one of these by hand. ``ScheduledChunk`` and ``ModelInput`` are
what crosses the process boundary to worker ranks, so they hold only what a rank needs. What a
runner hands back holds tensors and lives beside it (``worker/runner_output.py``); what a request
returns to its caller is ``outputs.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.engine.core.prompt_embeds import ChunkEmbeds, chunk_embeds, chunk_positions
from hf_paged.engine.core.sequence import Sequence


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
                                   state_slot=seq.state_slot, lora_key=seq.lora_key)  # fmt: skip
            if seq.bidirectional_ranges:  # those holding one of the chunk's queries
                chunk.bidirectional_ranges = [
                    (a, b) for a, b in seq.bidirectional_ranges if a < start + n and b > start
                ]
            if spec and sample:
                chunk.num_logits = 1 + len(spec)
            pe = seq.prompt_embeds
            if pe is not None:
                _add_prompt_embeds(chunk, pe, seq.num_prompt_tokens)
            chunks.append(chunk)
            if sample:
                sampled.append(seq)
        return ModelInput(chunks, self.blocks_to_copy, self.states_to_copy), sampled


def _add_prompt_embeds(chunk: ScheduledChunk, pe, prompt_len: int) -> None:
    """The chunk's share of its request's ``PromptEmbeds``: rows inside its window, M-RoPE
    positions (a decode token needs only the delta)."""
    n = len(chunk.token_ids)
    if chunk.start_pos < prompt_len:
        chunk.embeds = chunk_embeds(pe, chunk.start_pos, n)
    if pe.positions is not None:
        chunk.position_delta = pe.position_delta
        if not (n == 1 and chunk.start_pos >= prompt_len):
            chunk.mrope_positions = chunk_positions(pe, prompt_len, chunk.start_pos, n)


@dataclass
class PromptRows:
    """Rows of one chunk whose prompt logprobs are wanted (``SamplingParams.prompt_logprobs``).

    Row ``first + j`` of the chunk (position ``start_pos + first + j``) scores the prompt token
    ``target_ids[j]``, the token right after it.
    """

    first: int  # offset of the first scored row inside the chunk
    target_ids: list[int]  # the next prompt token of each scored row
    k: int  # top-k alternatives per row (0 = only the actual token)


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
    # rows fed instead of embed(id) at some of the chunk's positions (prompt embeddings)
    embeds: ChunkEmbeds | None = None
    # M-RoPE models: the chunk's positions [3, n] (None: a decode token, at start_pos + delta
    # on every section), and the delta of positions past the prompt
    mrope_positions: object | None = None
    position_delta: int = 0
    # the sequence's bidirectional ranges that hold a query of this chunk (``Sequence.
    # bidirectional_ranges``; each ends inside the chunk's context: the scheduler keeps it whole)
    bidirectional_ranges: list[tuple[int, int]] = field(default_factory=list)
    # the LoRA adapter its tokens run under (``Sequence.lora_key``); None: the base model
    lora_key: str | None = None


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
        """Every chunk is one token that is sampled from its id (CUDA-graph eligible)."""
        return all(
            len(c.token_ids) == 1 and c.sample and c.embeds is None and c.mrope_positions is None
            for c in self.chunks
        )

    @classmethod
    def synthetic_prefill(cls, lens: list[int], blocks_per_seq: int) -> ModelInput:
        """Whole prompts of ``lens`` tokens (the runner's warm-up); sequence i owns blocks
        [i * blocks_per_seq, (i + 1) * blocks_per_seq)."""
        k = blocks_per_seq
        return cls(
            [ScheduledChunk(i, [0] * n, 0, list(range(i * k, (i + 1) * k)), True)
             for i, n in enumerate(lens)]
        )  # fmt: skip


@dataclass(slots=True)
class TakenTokens:
    """Tokens a step appended to a sequence, ``seq.token_ids[first:last]``: what the engine
    applies the stop rule to (``Postprocessor.take``), in order.

    ``kind`` says where they come from: "sampled" (a synchronous step: sampled or verified
    speculative tokens, values on the host), "launched" (an overlapped step's placeholder: its
    value is still on the device, so only the length limits apply), "resolved" (a placeholder
    whose value reached the host: its full blocks are registered in the prefix cache first),
    "provided" (an external request's token from its caller: only ``max_model_len`` applies).
    """

    seq: Sequence
    first: int
    last: int
    kind: str = "sampled"
    logprobs: list | None = None  # per token, when the runner returned them
