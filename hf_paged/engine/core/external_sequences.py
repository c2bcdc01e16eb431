"""External-sampling sequences between their logits and their token, and beam-search beams.

An external request is sampled by its caller, never by the engine. When its next-token logits
are computed, ``step`` hands them out and the sequence pauses (``pause``), holding its blocks,
until the caller's token arrives (``take_token``, ``reset_tokens``, or ``provide_beams`` for a
beam search). When waiting sequences need those blocks, the newest paused one holding any is
parked (``park_newest``): its blocks are freed and it stays paused with status WAITING; it is
recomputed only once its token arrives (``_resume``). Recomputing it before would hand out the
same logits again, and could starve the sequences still waiting for theirs.

A beam-search request (``EngineRequest(..., external_sampling=True, beam_search=True)``) starts
with one sequence. Each time all its beams have their next-token logits (``StepResult.logits``
by ``(request_id, beam index)``), the caller gives every such request its next beams in one
``provide_beams`` call: beam ``j`` continues old beam ``parents[j]`` with ``token_ids[j]``. The
first child of a beam is that beam itself, the others are forks sharing its KV blocks
(``BlockManager.fork``; a shared block is copied only when a fork writes into it,
``BlockManager.allocate_slots``); a beam no new beam continues is freed. A parked beam has no
blocks: its children are recomputed (sharing what is still in the prefix cache), so a preempted
beam group is recomputed beam by beam, each from its own tokens, which gives exactly the KV it
had. A beam-search request never carries a proposer (``add_request`` refuses the combination).

``ExternalSequences`` is the only writer of the paused set; the engine holds one, as a
scheduler holds its queues, and ends sequences itself (``LLMEngine.finish_sequence``).
"""

from __future__ import annotations

from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.request_state import RequestState, RequestTable
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence


class ExternalSequences:
    """The engine's paused, parked and beam-forked external sequences.

    Args:
        scheduler / block_manager / requests: the engine's.
        vocab_size: provided token ids must be below it.
        max_model_len: the engine's sequence limit.

    Attributes:
        paused: seq_id -> a sequence whose logits were handed out, waiting for its token (a
            parked one holds no blocks and has status WAITING).
        num_parked: paused sequences whose blocks were freed for waiting ones (stats).
    """

    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, requests: RequestTable,
                 vocab_size: int, max_model_len: int):  # fmt: skip
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.requests = requests
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.paused: dict[int, Sequence] = {}
        self.num_parked = 0

    def __len__(self) -> int:
        return len(self.paused)

    def pause(self, seq: Sequence) -> None:
        """``seq`` (running, its logits handed out) holds its blocks and waits for its token."""
        self.scheduler.pause(seq)
        self.paused[seq.seq_id] = seq

    def forget(self, seq: Sequence) -> None:
        """``seq`` ends (aborted): it waits for nothing any more."""
        self.paused.pop(seq.seq_id, None)

    def awaits_token(self, request_id) -> bool:
        """The request is paused with its next-token logits handed out."""
        req = self.requests.by_id.get(request_id)
        return req is not None and req.seqs[0].seq_id in self.paused

    def park_newest(self) -> bool:
        """Free the blocks of the newest paused sequence holding any; False when none does."""
        holding = [s for s in self.paused.values() if s.block_table]
        if not holding:
            return False
        seq = max(holding, key=lambda s: s.arrival)
        self.block_manager.free(seq)
        seq.reset_for_recompute()  # stays paused until its token arrives
        self.num_parked += 1
        return True

    def take_token(self, request_id, token_id: int) -> Sequence:
        """Append ``token_id`` to a paused external request's sequence, which stops waiting; the
        engine then ends it or lets it go on (``resume``).

        Raises:
            ValueError: not an open external request waiting for a token (or a beam search), or
                ``token_id`` outside the vocabulary; nothing changes then.
        """
        seq = self._external_request(request_id, "provide_token").seqs[0]
        if seq.seq_id not in self.paused:
            raise ValueError(f"request_id={request_id!r} is not waiting for a token")
        if not (0 <= token_id < self.vocab_size):
            raise ValueError(
                f"token_id={token_id} is not allowed: must be in [0, {self.vocab_size})"
            )
        del self.paused[seq.seq_id]
        seq.append_token(int(token_id))
        return seq

    def resume(self, seq: Sequence) -> None:
        """A sequence that got its token goes on: running, or (parked) recomputed."""
        self.scheduler.resume(seq)

    def reset_tokens(self, request_id, token_ids: list[int]) -> None:
        """Make an external request's sequence hold exactly ``token_ids`` (its prompt first).
        The KV of the longest common prefix is kept (but for the last token, which is computed
        again so that the next step returns the logits after it), the rest is rolled back; the
        request runs again and pauses with those logits (a draft model's request after the
        target's verification).

        Raises:
            ValueError: not an open external request (or a beam search), ``token_ids`` does not
                start with its prompt, or is as long as ``max_model_len``.
        """
        req = self._external_request(request_id, "reset_tokens")
        seq, ids = req.seqs[0], list(token_ids)
        if ids[: seq.num_prompt_tokens] != req.prompt_token_ids:
            raise ValueError(
                f"token_ids is not allowed for request_id={request_id!r}: must start with its "
                f"prompt ({seq.num_prompt_tokens} tokens)"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"token_ids of {len(ids)} tokens is not allowed: must be < "
                f"max_model_len={self.max_model_len}"
            )
        common = seq.num_prompt_tokens
        limit = min(len(seq), len(ids))
        while common < limit and seq.token_ids[common] == ids[common]:
            common += 1
        self.scheduler.rollback(seq, common, num_computed=min(common, len(ids) - 1))
        seq.token_ids.extend(ids[common:])
        if self.paused.pop(seq.seq_id, None) is not None:
            self.resume(seq)  # a preempted (not paused) one stays in ``waiting``

    def provide_beams(self, request_ids: list, parents: list[list[int]],
                      token_ids: list[list[int]]) -> None:  # fmt: skip
        """Give every request of ``request_ids`` its next beams (see the module docstring).

        Raises:
            ValueError: a request that is not a beam search waiting for tokens, a bad parent or
                token, or a beam that would reach ``max_model_len``; nothing changes then.
        """
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"request_ids={list(request_ids)} is not allowed: ids must differ")
        plans = [self._check_beams(*a) for a in zip(request_ids, parents, token_ids, strict=True)]
        for req, par, toks in plans:
            self._reseat(req, par, toks)

    # ---- internals ----------------------------------------------------------------------

    def _external_request(self, request_id, what: str) -> RequestState:
        req = self.requests.by_id.get(request_id)
        if req is None or not req.external or req.seqs[0].is_finished:
            raise ValueError(f"request_id={request_id!r} is not an open external-sampling request")
        if req.beam_search:
            raise ValueError(
                f"{what} is not allowed for request_id={request_id!r}: it is a beam search "
                "(its beams take their tokens from provide_beams)"
            )
        return req

    def _check_beams(self, request_id, parents, token_ids):
        req = self.requests.by_id.get(request_id)
        if req is None or not req.beam_search:
            raise ValueError(f"request_id={request_id!r} is not a beam-search request in flight")
        k, vocab = len(req.seqs), self.vocab_size
        if not all(s.seq_id in self.paused for s in req.seqs):
            raise ValueError(f"request_id={request_id!r}: not every beam is waiting for a token")
        par, toks = [int(p) for p in parents], [int(t) for t in token_ids]
        if not par or len(par) != len(toks):
            raise ValueError(f"parents={par} and token_ids={toks}: need equal, non-zero lengths")
        if not all(0 <= p < k for p in par) or not all(0 <= t < vocab for t in toks):
            raise ValueError(
                f"parents={par} / token_ids={toks} are not allowed: parents must be in [0, {k}) "
                f"and token ids in [0, {vocab})"
            )
        if max(len(req.seqs[p]) for p in par) + 1 >= self.max_model_len:
            raise ValueError(f"request_id={request_id!r}: a beam would reach max_model_len")
        return req, par, toks

    def _reseat(self, req: RequestState, parents: list[int], token_ids: list[int]) -> None:
        children: list[list[int]] = [[] for _ in req.seqs]
        for j, p in enumerate(parents):
            children[p].append(j)
        new: list[Sequence | None] = [None] * len(parents)
        for seq, kids in zip(req.seqs, children):
            del self.paused[seq.seq_id]
            if not kids:  # dropped: its references go (blocks only it held are free again)
                self.scheduler.finish(seq, "abort")
                continue
            forks = [seq]
            for _ in kids[1:]:
                child = seq.fork()
                self.block_manager.fork(seq, child)
                forks.append(child)
            for j, s in zip(kids, forks):
                s.append_token(token_ids[j])
                new[j] = s
                self.resume(s)
        self.requests.set_seqs(req, new)
