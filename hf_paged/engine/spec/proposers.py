"""Proposers: where the speculative tokens a request's next step verifies come from.

A proposer takes a batch of sequences in decode state and returns, per sequence, up to a given
number of tokens that are likely to follow it, and (for sampled requests) the distribution each
was drawn from. The engine verifies them in one forward pass of its model (``spec_decode.py``);
what a proposer proposes changes only how many tokens a step keeps, never which tokens.

- ``NgramProposer``: prompt lookup (transformers' ``PromptLookupCandidateGenerator``): the last
  ``n`` tokens (``max_matching_ngram_size`` down to 1) are looked up in the sequence so far,
  prompt and output alike, and the tokens after their first earlier occurrence are proposed.
- ``DraftModelProposer``: a smaller model with the same vocabulary (transformers'
  ``AssistedCandidateGenerator``), run as a second ``LLMEngine`` in the same process.

Both implement ``propose``, ``observe`` (the verification's outcome) and ``release`` (the
sequence finished).
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

import torch

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.core.request_loop import RequestGroup
from hf_paged.engine.core.sequence import Sequence
from hf_paged.layers.sampler import (
    SamplingMetadata,
    apply_penalties,
    argmax_rows,
    random_sample,
    sampling_probs,
)

SCHEDULES = ("constant", "heuristic", "heuristic_transient")


@dataclass
class ProposalRequest:
    """One sequence to propose for."""

    seq: Sequence  # the sequence; its ``token_ids`` are the context (never changed here)
    max_tokens: int  # propose at most this many (>= 1)
    params: SamplingParams  # how the request samples (a draft model drafts the same way)
    stop_ids: tuple[int, ...]  # ids that end the request: a proposal stops before the first
    generator: torch.Generator | None  # the request's own (seeded) generator, or None


@dataclass
class Proposal:
    token_ids: list[int]  # proposed tokens (possibly none)
    # [len(token_ids), V] float32: the distribution each token was drawn from (a sampled
    # request with a draft model), else None (verified by matching the model's own draws)
    probs: torch.Tensor | None = None


def _check_int(name: str, value, lo: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{name}={value!r} is not allowed: must be an int >= {lo}")


def _cut_at_stop(tokens: list[int], stop_ids: SequenceLike[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[:i]
    return tokens


class _NgramIndex:
    """The first start of every n-gram (n <= max_n) of one growing token list."""

    def __init__(self, max_n: int):
        self.max_n = max_n
        self.first: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]
        self.size = 0  # leading tokens indexed

    def update(self, tokens: list[int]) -> None:
        if len(tokens) < self.size:  # the list was cut: start again
            self.__init__(self.max_n)
        for end in range(self.size + 1, len(tokens) + 1):
            for n in range(1, min(self.max_n, end) + 1):
                self.first[n].setdefault(tuple(tokens[end - n : end]), end - n)
        self.size = len(tokens)

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        """Stock's candidates: for n from ``max_n`` down to 1, the tokens after the first
        occurrence of the last n tokens that has tokens after it (at most ``k``)."""
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), 0, -1):
            start = self.first[n].get(tuple(tokens[length - n :]))
            if start is not None and start + n < length:
                return tokens[start + n : min(start + n + k, length)]
        return []


class NgramProposer:
    """Prompt lookup: ``prompt_lookup_num_tokens`` / ``max_matching_ngram_size`` as in stock.

    Args:
        num_tokens: most tokens proposed per step (``prompt_lookup_num_tokens``).
        max_matching_ngram_size: longest n-gram looked up (stock's default 2).
        backoff: after a step that kept none of a sequence's proposals, skip proposing for it
            3 steps, after a second such step in a row 15, then 63, then 255 (at most), until a
            proposal is kept again: a verification step costs more than a plain decode step
            (it runs eagerly, not as a CUDA graph), so text the lookup does not predict must not
            pay for it every step (a speed choice of ours; stock proposes every step).

    Raises:
        ValueError: a count that is not a positive int.
    """

    def __init__(self, num_tokens: int = 10, max_matching_ngram_size: int = 2, backoff=True):
        _check_int("num_tokens", num_tokens, 1)
        _check_int("max_matching_ngram_size", max_matching_ngram_size, 1)
        self.num_tokens = num_tokens
        self.max_matching_ngram_size = max_matching_ngram_size
        self.backoff = backoff
        self._index: dict[int, _NgramIndex] = {}  # seq_id -> its n-gram index
        self._misses: dict[int, int] = {}  # seq_id -> steps in a row that kept nothing
        self._skip: dict[int, int] = {}  # seq_id -> steps left without proposals

    def propose(self, items: list[ProposalRequest]) -> list[Proposal]:
        out = []
        for it in items:
            sid = it.seq.seq_id
            if self._skip.get(sid, 0) > 0:
                self._skip[sid] -= 1
                out.append(Proposal([]))
                continue
            index = self._index.get(sid)
            if index is None:
                index = self._index[sid] = _NgramIndex(self.max_matching_ngram_size)
            index.update(it.seq.token_ids)
            tokens = index.lookup(it.seq.token_ids, min(self.num_tokens, it.max_tokens))
            out.append(Proposal(_cut_at_stop(tokens, it.stop_ids)))
        return out

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if not self.backoff or num_proposed == 0:
            return
        sid = seq.seq_id
        if num_accepted:
            self._misses.pop(sid, None)
            return
        misses = self._misses[sid] = self._misses.get(sid, 0) + 1
        self._skip[sid] = min(4**misses, 256) - 1

    def release(self, seq: Sequence) -> None:
        for d in (self._index, self._misses, self._skip):
            d.pop(seq.seq_id, None)


class DraftModelProposer:
    """A draft model run as a second engine: ``num_assistant_tokens``,
    ``num_assistant_tokens_schedule`` and ``assistant_confidence_threshold`` as in stock.

    Each target sequence has one external-sampling request in ``engine`` holding the same tokens
    (its KV rolled back to what the target kept, ``LLMEngine.reset_tokens``). A round of
    proposals steps ``engine`` once per drafted position for all sequences at once; each token
    is drawn as the target request samples (greedy, or from the draft's distribution with the
    request's temperature, top-k/p, min-p and penalties, from the request's generator).

    Args:
        engine: an ``LLMEngine`` over the draft model (the target's vocabulary), or an ``LLM``
            (its engine is used).
        num_tokens: tokens drafted per step to start with (``num_assistant_tokens``).
        schedule: "constant"; "heuristic" / "heuristic_transient": +2 after a step that kept
            every drafted token, else -1 (at least 1), per sequence.
        confidence_threshold: stop drafting a sequence after a token the draft gives less than
            this probability (None or 0 = never).
        generator: for sampled requests without a seed (None = torch's global RNG).

    Raises:
        ValueError: a bad count, schedule or threshold.
    """

    def __init__(
        self,
        engine,
        num_tokens: int = 20,
        schedule: str = "constant",
        confidence_threshold: float | None = None,
        generator: torch.Generator | None = None,
    ):
        _check_int("num_tokens", num_tokens, 1)
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule={schedule!r} is not allowed: must be one of {SCHEDULES}")
        if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
            raise ValueError(
                f"confidence_threshold={confidence_threshold!r} is not allowed: must be None or "
                "in [0, 1]"
            )
        self.engine = getattr(engine, "engine", engine)  # an LLM's engine
        self.num_tokens = num_tokens
        self.schedule = schedule
        self.confidence_threshold = confidence_threshold or None
        self.generator = generator
        self._rid: dict[int, object] = {}  # target seq_id -> its request id in ``engine``
        # the draft requests, driven by the request loop (its outputs are not kept: every draft
        # request ends aborted)
        self._group = RequestGroup(self.engine, keep_outputs=False)
        self._k: dict[int, int] = {}  # target seq_id -> tokens to draft (heuristic schedules)
        self._params = SamplingParams(temperature=0.0, max_tokens=1)  # never read: external

    def propose(self, items: list[ProposalRequest]) -> list[Proposal]:
        limit = self.engine.runtime.max_model_len
        drafts: list[list[int]] = [[] for _ in items]
        probs: list[list[torch.Tensor]] = [[] for _ in items]
        want = [0] * len(items)
        active = []  # indices into items still drafting
        blocks, budget = 0, self.engine.runtime.num_kv_blocks
        for i, it in enumerate(items):
            k = min(self._k.get(it.seq.seq_id, self.num_tokens), it.max_tokens)
            k = min(k, limit - len(it.seq) - 1)
            need = -(-(len(it.seq) + k) // self.engine.config.kv_block_size)
            if k < 1 or blocks + need > budget:  # the draft engine must hold a round at once
                continue
            blocks += need
            want[i] = k
            active.append(i)
        # only this round's sequences hold draft KV, so that they can all wait with their
        # logits at once (the others are drafted for again later, from the draft's prefix cache)
        live = {items[i].seq.seq_id for i in active}
        for sid in [s for s in self._rid if s not in live]:
            self._group.close(self._rid.pop(sid))
        for i in active:
            self._sync(items[i].seq)
        # draws come from the target requests' generators: on the target's device
        dev = next((it.generator.device for it in items if it.generator is not None), None)
        while active:
            logits = self._collect([self._rid[items[i].seq.seq_id] for i in active])
            logits = logits if dev is None else logits.to(dev)
            tokens, q, conf = self._draw(logits, [items[i] for i in active],
                                         [drafts[i] for i in active])  # fmt: skip
            still = []
            for row, i in enumerate(active):
                it, tok = items[i], tokens[row]
                if tok in it.stop_ids:  # stock's draft stops at EOS; a proposal ends before it
                    continue
                drafts[i].append(tok)
                if q is not None and not it.params.greedy:
                    probs[i].append(q[row])
                low = (
                    self.confidence_threshold is not None and conf[row] < self.confidence_threshold
                )
                if len(drafts[i]) < want[i] and not low:
                    self.engine.provide_token(self._rid[it.seq.seq_id], tok)
                    still.append(i)
            active = still
        return [
            Proposal(d, torch.stack(p) if p else None) if d else Proposal([])
            for d, p in zip(drafts, probs, strict=True)
        ]

    def observe(self, seq: Sequence, num_proposed: int, num_accepted: int) -> None:
        if self.schedule == "constant" or num_proposed == 0:
            return
        k = self._k.get(seq.seq_id, self.num_tokens)
        self._k[seq.seq_id] = k + 2 if num_accepted == num_proposed else max(1, k - 1)

    def release(self, seq: Sequence) -> None:
        self._k.pop(seq.seq_id, None)
        rid = self._rid.pop(seq.seq_id, None)
        if rid is not None:
            self._group.close(rid)

    # ---- the draft engine ---------------------------------------------------------------

    def _sync(self, seq: Sequence) -> None:
        """The draft request of ``seq`` holds exactly ``seq.token_ids`` and runs next step."""
        rid = self._rid.get(seq.seq_id)
        if rid is not None and rid in self.engine.requests:
            try:
                self.engine.reset_tokens(rid, seq.token_ids)
                return
            except ValueError:  # its prompt is no longer a prefix: start it again
                self._group.close(rid)
        self._rid[seq.seq_id] = self._group.add(
            EngineRequest(seq.token_ids, self._params, external_sampling=True)
        )

    def _collect(self, rids: list) -> torch.Tensor:
        """Step the draft engine until every request of ``rids`` waits with its next-token
        logits; ``[len(rids), V]`` raw logits (float32, the draft engine's device).

        Raises:
            RuntimeError: the draft engine made no progress (``RequestGroup.await_logits``)."""
        eng = self.engine
        budget = 4 * len(rids) + sum(len(eng.requests.by_id[r].seqs[0]) for r in rids)
        got = self._group.await_logits([(r, 0) for r in rids], budget)
        return torch.stack([got[(r, 0)] for r in rids])

    def _draw(self, logits: torch.Tensor, items: list[ProposalRequest], drafts):
        """One token per row as the target request samples, after its history plus the tokens
        drafted so far; ``(tokens, q [A, V] or None, confidences)``."""
        meta = SamplingMetadata(
            params=[it.params for it in items],
            prompt_token_ids=[it.seq.token_ids[: it.seq.num_prompt_tokens] for it in items],
            output_token_ids=[it.seq.output_token_ids + d for it, d in zip(items, drafts)],
            stop_token_ids=[it.stop_ids for it in items],
            generators=[it.generator for it in items],
        )
        sampled = [i for i, it in enumerate(items) if not it.params.greedy]
        if not sampled:
            penalised = apply_penalties(logits.float(), meta)
            tokens = argmax_rows(penalised)
            conf = penalised.softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
            return tokens.tolist(), None, conf.tolist()
        q = sampling_probs(logits, meta)  # [A, V]; one-hot rows for greedy requests
        gens = [it.generator for it in items]
        tokens = random_sample(q, gens, self.generator)
        penalised = apply_penalties(logits.float(), meta)
        greedy_conf = penalised.softmax(dim=-1).gather(1, tokens[:, None])[:, 0]
        conf = torch.where(torch.tensor([not it.params.greedy for it in items],
                                        device=q.device),
                           q.gather(1, tokens[:, None])[:, 0], greedy_conf)  # fmt: skip
        return tokens.tolist(), q, conf.tolist()
