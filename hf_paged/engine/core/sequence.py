"""One generation stream: its tokens, how many have KV in the cache, and its blocks. No torch."""

from __future__ import annotations

import enum
from itertools import count

from hf_paged.config import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # never scheduled, or preempted (recompute from scratch)
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A prompt plus the tokens generated so far.

    ``num_computed_tokens`` tokens (a prefix of ``token_ids``) have their KV in ``block_table``'s
    blocks; the rest are computed by later steps (a prefill chunk, or the last sampled token in a
    decode step). ``num_cached_tokens`` of those came from the prefix cache, not a forward pass.
    ``spec_token_ids`` are proposed tokens that follow ``token_ids`` but are not part of them:
    the next step computes them with the last token and keeps the prefix the model agrees with.
    """

    _ids = count()

    def __init__(
        self,
        token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | int | None = None,
        arrival: int | None = None,
    ):
        self.seq_id: int = next(Sequence._ids)
        self.request_id = request_id if request_id is not None else self.seq_id
        self.token_ids: list[int] = list(token_ids)
        self.num_prompt_tokens: int = len(token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # hashes of the leading full blocks, once computed
        self.state_slot: int = 0  # recurrent models: its state-pool slot while it holds blocks
        self.num_preemptions: int = 0
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.arrival: int = arrival if arrival is not None else self.seq_id  # FCFS order key
        # prefix-cache hits may cover at most this many leading tokens (None: no limit); set by
        # the engine while prompt logprob rows are still to be computed
        self.max_cached_tokens: int | None = None
        # speculative tokens after ``token_ids``, to be verified by the next step that runs it
        # (only requests with a proposer have any; see ``engine/spec/spec_decode.py``)
        self.spec_token_ids: list[int] = []
        # rows the prompt feeds instead of ids at some positions, and M-RoPE positions
        # (``core/prompt_embeds.py``); shared by the request's sequences, never written
        self.prompt_embeds = None
        # prompt positions [start, end), sorted and disjoint, whose tokens attend to each other
        # both ways (an image of Gemma 3); the scheduler never ends a prefill chunk inside one
        self.bidirectional_ranges: list[tuple[int, int]] = []
        # the LoRA adapter its tokens run under (``models/adapters``: name plus a digest of its
        # weights), None for the base model; it is also the prefix cache's salt, so KV computed
        # under one adapter never serves another
        self.lora_key: str | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, len={len(self)}, prompt={self.num_prompt_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def fork(self) -> Sequence:
        """A new sequence (its own ``seq_id``) with this one's tokens, progress, request, arrival
        and status, and no blocks: ``BlockManager.fork`` gives it this one's blocks."""
        child = Sequence(self.token_ids, self.sampling_params, self.request_id, self.arrival)
        child.num_prompt_tokens = self.num_prompt_tokens
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.max_cached_tokens = self.max_cached_tokens
        child.prompt_embeds = self.prompt_embeds
        child.bidirectional_ranges = self.bidirectional_ranges
        child.lora_key = self.lora_key
        return child

    def reset_for_recompute(self) -> None:
        """Preempted: drop its KV; prompt and output so far are recomputed later."""
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.block_table = []
        self.block_hashes = []
        self.spec_token_ids = []
        self.num_preemptions += 1
