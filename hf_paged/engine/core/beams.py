"""Beam-search requests on the engine: beams are sequences whose block tables are forks.

A beam-search request (``add_request(..., external_sampling=True, beam_search=True)``) starts
with one sequence. Each time all its beams have their next-token logits (``step`` reports them
in ``StepResult.beam_logits`` by ``(request_id, beam index)`` and pauses the beams), the caller
gives every such request its next beams in one ``provide_beams`` call: beam ``j`` continues old
beam ``parents[j]`` with ``token_ids[j]``. The first child of a beam is that beam itself, the
others are forks sharing its KV blocks (``BlockManager.fork``; a shared block is copied only
when a fork writes into it, ``BlockManager.allocate_slots``); a beam no new beam continues is
freed. A parked beam (``paused.py``) has no blocks: its children are recomputed (sharing what
is still in the prefix cache), so a preempted beam group is recomputed beam by beam, each from
its own tokens, which gives exactly the KV it had.

A beam-search request never carries a proposer (``add_request`` refuses the combination).
"""

from __future__ import annotations

from hf_paged.engine.core.paused import resume
from hf_paged.engine.core.request_state import RequestState
from hf_paged.engine.core.sequence import Sequence


def provide_beams(engine, request_ids: list, parents: list[list[int]],
                  token_ids: list[list[int]]) -> None:  # fmt: skip
    """Give every request of ``request_ids`` its next beams (see the module docstring).

    Raises:
        ValueError: a request that is not a beam search waiting for tokens, a bad parent or
            token, or a beam that would reach ``max_model_len``; nothing changes then.
    """
    if len(set(request_ids)) != len(request_ids):
        raise ValueError(f"request_ids={list(request_ids)} is not allowed: ids must differ")
    plans = [_check(engine, *a) for a in zip(request_ids, parents, token_ids, strict=True)]
    for req, par, toks in plans:
        _reseat(engine, req, par, toks)


def _check(engine, request_id, parents, token_ids):
    req = engine.requests.by_id.get(request_id)
    if req is None or not req.beam_search:
        raise ValueError(f"request_id={request_id!r} is not a beam-search request in flight")
    k, vocab = len(req.seqs), engine.runtime.vocab_size
    if not all(s.seq_id in engine._paused for s in req.seqs):
        raise ValueError(f"request_id={request_id!r}: not every beam is waiting for a token")
    par, toks = [int(p) for p in parents], [int(t) for t in token_ids]
    if not par or len(par) != len(toks):
        raise ValueError(f"parents={par} and token_ids={toks}: need equal, non-zero lengths")
    if not all(0 <= p < k for p in par) or not all(0 <= t < vocab for t in toks):
        raise ValueError(
            f"parents={par} / token_ids={toks} are not allowed: parents must be in [0, {k}) "
            f"and token ids in [0, {vocab})"
        )
    if max(len(req.seqs[p]) for p in par) + 1 >= engine.runtime.max_model_len:
        raise ValueError(f"request_id={request_id!r}: a beam would reach max_model_len")
    return req, par, toks


def _reseat(engine, req: RequestState, parents: list[int], token_ids: list[int]) -> None:
    children: list[list[int]] = [[] for _ in req.seqs]
    for j, p in enumerate(parents):
        children[p].append(j)
    new: list[Sequence | None] = [None] * len(parents)
    for seq, kids in zip(req.seqs, children):
        del engine._paused[seq.seq_id]
        if not kids:  # dropped: its references go (blocks only it held are free again)
            engine.scheduler.finish(seq, "abort")
            continue
        forks = [seq]
        for _ in kids[1:]:
            child = seq.fork()
            engine.block_manager.fork(seq, child)
            forks.append(child)
        for j, s in zip(kids, forks):
            s.append_token(token_ids[j])
            new[j] = s
            resume(engine, s)
    engine.requests.set_seqs(req, new)
