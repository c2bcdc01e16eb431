"""What the engine keeps per request, and the table that owns it.

``RequestState`` is one request's sequences and everything derived from its parameters once, at
``add_request`` (stop ids, stop-string matcher, prompt-logprob state); it decides when one of its
sequences stops and builds the request's ``RequestOutput``. ``RequestTable`` is the only writer of
the engine's request registry: by id, by sequence id, seeded generators, and which sequences
finished since the last collection.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from hf_paged.config import SamplingParams
from hf_paged.engine.core.contracts import ScheduledChunk
from hf_paged.engine.core.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.core.prompt_logprobs import PromptLogprobState
from hf_paged.engine.core.proposer import Proposer
from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.core.stop import StopMatcher, check_stop


def overlap_eligible(params: SamplingParams, external: bool) -> bool:
    """Whether a request's sampling and stopping can run without its token values on the host
    (overlapped stepping, ``engine/overlap.py``)."""
    return (
        not external
        and params.logprobs is None
        and params.repetition_penalty == 1.0
        and (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)
    )


@dataclass
class RequestState:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    external: bool  # sampled by the caller (``provide_token``), never by the engine
    sync_only: bool  # overlapped stepping cannot serve it
    stop_ids: tuple[int, ...]  # ids that end it: EOS (unless ignore_eos) + stop_token_ids
    stop_strings: StopMatcher | None = None  # matcher for params.stop
    prompt_lps: PromptLogprobState | None = None  # with params.prompt_logprobs (seqs[0] scores)
    logprobs: dict[int, list] = field(default_factory=dict)  # seq_id -> per-token logprobs
    proposer: Proposer | None = None  # proposes speculative tokens (``engine/spec/proposers.py``)
    # external beam search: ``seqs`` are its beams, replaced each step by ``provide_beams``
    beam_search: bool = False

    @classmethod
    def build(
        cls, request_id, prompt: str | None, ids: list[int], params: SamplingParams,
        external: bool, eos_token_ids: tuple[int, ...], stop_strings: StopMatcher | None,
        proposer: Proposer | None = None,
    ) -> RequestState:  # fmt: skip
        """A new request's state: ``params.n`` sequences of ``ids``, its stop ids (the model's
        EOS ids unless ``ignore_eos``, then ``stop_token_ids``) and prompt-logprob state. A
        request with a ``proposer`` steps synchronously (its tokens are verified on the host)."""
        seqs = [Sequence(ids, params, request_id=request_id) for _ in range(params.n)]
        eos = () if params.ignore_eos else tuple(eos_token_ids)
        req = cls(
            request_id, prompt, ids, params, seqs, external,
            sync_only=proposer is not None or not overlap_eligible(params, external),
            stop_ids=eos + params.stop_token_ids, stop_strings=stop_strings, proposer=proposer,
        )  # fmt: skip
        if params.prompt_logprobs is not None:
            scored = (
                ids if params.prompt_logprobs_next is None else [*ids, params.prompt_logprobs_next]
            )
            req.prompt_lps = PromptLogprobState(
                scored, params.prompt_logprobs, params.prompt_logprobs_start
            )
            seqs[0].max_cached_tokens = req.prompt_lps.max_cached_tokens
        return req

    def stop_reason(self, seq: Sequence, end: int, max_model_len: int,
                    known: bool = True) -> str | None:  # fmt: skip
        """The finish reason once ``seq`` holds its first ``end`` tokens, or None to go on: the
        one place ``check_stop`` is called. ``known``: the newest token's value is on the host
        (else only the length limits apply). An external request's tokens are its caller's:
        only ``max_model_len`` applies to it."""
        num_output = end - seq.num_prompt_tokens
        if self.external:  # no token value, no max_tokens (0 output tokens < max_tokens >= 1)
            num_output, known = 0, False
        token = seq.token_ids[end - 1] if known else None
        matcher = self.stop_strings if known else None
        hit = matcher is not None and matcher.matches(seq.token_ids, end)
        return check_stop(
            num_output, token, end, self.params, self.stop_ids, max_model_len, stop_string_hit=hit
        )

    def output(self, tokenizer) -> RequestOutput:
        """The request's ``RequestOutput`` (text decoded when there is a tokenizer)."""
        outs = []
        for i, seq in enumerate(self.seqs):
            ids = seq.output_token_ids
            text = None
            if tokenizer is not None:
                text = tokenizer.decode(ids, skip_special_tokens=self.params.skip_special_tokens)
            lps = self.logprobs.get(seq.seq_id) if self.params.logprobs is not None else None
            outs.append(CompletionOutput(i, ids, text, seq.finish_reason, lps))
        plps = self.prompt_lps.entries if self.prompt_lps is not None else None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, outs, plps)


class RequestTable:
    """The engine's requests by id and by sequence id, with their seeded generators.

    Attributes:
        by_id: request id -> RequestState, until the request is reported.
        num_sync: requests in the table that overlapped stepping cannot serve.
        num_spec: requests in the table with a proposer.

    It also keeps which open ``RequestGroup`` (``request_loop.py``) added each request, so that
    a request finished by another group's step is recorded in its own (``join_group`` /
    ``leave_group``); a request id leaves when its group records its output.
    """

    def __init__(self, new_generator: Callable[[int], object]):
        self.new_generator = new_generator  # seed -> a seeded generator on the engine's device
        self.by_id: dict[int | str, RequestState] = {}
        self._by_seq: dict[int, RequestState] = {}
        self._generators: dict[int, object] = {}  # seq_id -> its seeded generator
        self._maybe_done: set[int] = set()  # seq ids finished since the last ``take_done``
        self._groups: dict = {}  # request id -> the open RequestGroup that added it
        self.num_sync = 0
        self.num_spec = 0

    def __contains__(self, request_id) -> bool:
        return request_id in self.by_id

    def __bool__(self) -> bool:
        return bool(self.by_id)

    def __len__(self) -> int:
        return len(self.by_id)

    def add(self, req: RequestState) -> None:
        """Register ``req`` and its sequences; seeded sampling gets one generator per sequence
        (seed + index)."""
        if req.request_id in self.by_id:
            raise ValueError(f"request_id={req.request_id!r} is not allowed: it is already in use")
        seed = req.params.seed  # generators first: what raises leaves the table as it was
        n = len(req.seqs)
        generators = [] if seed is None else [self.new_generator(seed + i) for i in range(n)]
        self.by_id[req.request_id] = req
        self.num_sync += req.sync_only
        self.num_spec += req.proposer is not None
        for seq in req.seqs:
            self._by_seq[seq.seq_id] = req
        for seq, g in zip(req.seqs, generators):
            self._generators[seq.seq_id] = g

    def join_group(self, request_id, group) -> None:
        """``group`` added ``request_id``: its output goes there."""
        self._groups[request_id] = group

    def leave_group(self, request_id):
        """The group that added ``request_id`` (None: none is open), forgotten now."""
        return self._groups.pop(request_id, None)

    def kv_slots(self, request_ids: list, block_size: int) -> list[list[int]]:
        """Per request, the KV-cache slot (``block * block_size + offset``) of each computed
        token of its one sequence, in order.

        Raises:
            ValueError: a request unknown, with several sequences, or not holding its blocks.
        """
        out = []
        for rid in request_ids:
            req = self.by_id.get(rid)
            if req is None or len(req.seqs) != 1:
                raise ValueError(f"request_id={rid!r} is not a running single-sequence request")
            seq = req.seqs[0]
            n = seq.num_computed_tokens
            if len(seq.block_table) * block_size < n:
                raise ValueError(f"request_id={rid!r} does not hold its KV blocks")
            table = seq.block_table
            out.append([table[p // block_size] * block_size + p % block_size for p in range(n)])
        return out

    def state_slots(self, request_ids: list) -> list[int]:
        """Per request, the state-pool slot of its one sequence.

        Raises:
            ValueError: a request unknown, with several sequences, or holding no slot.
        """
        slots = []
        for rid in request_ids:
            req = self.by_id.get(rid)
            if req is None or len(req.seqs) != 1 or not req.seqs[0].state_slot:
                raise ValueError(f"request_id={rid!r} holds no state slot")
            slots.append(req.seqs[0].state_slot)
        return slots

    def set_seqs(self, req: RequestState, seqs: list[Sequence]) -> None:
        """Make ``seqs`` the sequences of ``req`` (beam search); those it drops are forgotten."""
        keep = {s.seq_id for s in seqs}
        for seq in req.seqs:
            if seq.seq_id not in keep:
                self._by_seq.pop(seq.seq_id, None)
                self._generators.pop(seq.seq_id, None)
        for seq in seqs:
            self._by_seq[seq.seq_id] = req
        req.seqs = list(seqs)

    def of(self, seq_id: int) -> RequestState | None:
        """The request a sequence belongs to (None once reported)."""
        return self._by_seq.get(seq_id)

    def mark_finished(self, seq: Sequence) -> None:
        self._maybe_done.add(seq.seq_id)

    def take_done(self, ready=None) -> list[RequestState]:
        """Remove and return the requests whose sequences all finished since the last call.

        Args:
            ready: ``seq_id -> bool``; a request with a sequence not ready (its last token still
                on the device) stays for a later call.
        """
        done, later = [], set()
        for seq_id in self._maybe_done:
            req = self._by_seq.get(seq_id)
            if req is None or req.request_id not in self.by_id:
                continue
            if not all(s.is_finished for s in req.seqs):
                continue
            if ready is not None and not all(ready(s.seq_id) for s in req.seqs):
                later.add(seq_id)
                continue
            del self.by_id[req.request_id]
            self.num_sync -= req.sync_only
            self.num_spec -= req.proposer is not None
            for seq in req.seqs:
                self._by_seq.pop(seq.seq_id, None)
                self._generators.pop(seq.seq_id, None)
            done.append(req)
        self._maybe_done = later
        return done

    def generator(self, seq: Sequence):
        """The seeded generator of ``seq`` (None without a seed)."""
        return self._generators.get(seq.seq_id)

    def prompt_rows(self, seq: Sequence, start: int, n: int):
        """The prompt-logprob rows a chunk of ``seq`` (``n`` tokens from ``start``) scores, or
        None; taken now (their scores may arrive a step later)."""
        req = self._by_seq[seq.seq_id]
        state = req.prompt_lps
        if state is None or seq.seq_id != req.seqs[0].seq_id:
            return None
        rows = state.rows_for(start, n)
        seq.max_cached_tokens = state.max_cached_tokens
        return rows

    def record_prompt_logprobs(self, chunks: list[ScheduledChunk], scores: dict) -> None:
        """Store a step's prompt-logprob ``scores`` (seq id -> entries) with their requests."""
        for c in chunks:
            req = self._by_seq.get(c.seq_id)
            if c.seq_id in scores and req is not None:  # None: aborted and reported meanwhile
                req.prompt_lps.record(c, scores[c.seq_id])
