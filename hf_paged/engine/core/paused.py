"""External-sampling sequences between their logits and their token (``LLMEngine``'s side).

When an external request's next-token logits are computed, ``step`` hands them out and the
sequence pauses (``engine._paused``: seq_id -> Sequence), holding its blocks, until the caller's
token arrives (``provide_token``, ``reset_tokens``, or ``beams.provide_beams`` for a beam
search). When waiting sequences need those blocks, the newest paused one holding any is parked
(``park_newest``): its blocks are freed and it stays paused with status WAITING; it is
recomputed only once its token arrives (``resume``). Recomputing it before would hand out the
same logits again, and could starve the sequences still waiting for theirs.

Functions of the engine; ``LLMEngine`` exposes them as methods.
"""

from __future__ import annotations

from hf_paged.engine.core.sequence import Sequence, SequenceStatus


def resume(engine, seq: Sequence) -> None:
    """A paused sequence that got its token goes on: running, or (parked) recomputed."""
    if seq.status == SequenceStatus.WAITING:
        engine.scheduler.add(seq)
    else:
        engine.scheduler.running.append(seq)


def park_newest(engine) -> bool:
    """Free the blocks of the newest paused sequence holding any; False when none does."""
    holding = [s for s in engine._paused.values() if s.block_table]
    if not holding:
        return False
    seq = max(holding, key=lambda s: s.arrival)
    engine.block_manager.free(seq)
    seq.reset_for_recompute()  # stays in _paused until its token arrives
    engine.num_parked += 1
    return True


def _external_request(engine, request_id, what: str):
    req = engine.requests.by_id.get(request_id)
    if req is None or not req.external or req.seqs[0].is_finished:
        raise ValueError(f"request_id={request_id!r} is not an open external-sampling request")
    if req.beam_search:
        raise ValueError(
            f"{what} is not allowed for request_id={request_id!r}: it is a beam search "
            "(its beams take their tokens from provide_beams)"
        )
    return req


def provide_token(engine, request_id, token_id: int, finish: bool = False) -> None:
    """Append ``token_id`` to a paused external request; ``finish`` ends it.

    Raises:
        ValueError: not an open external request waiting for a token (or a beam search), or
            ``token_id`` outside the vocabulary; nothing changes then.
    """
    seq = _external_request(engine, request_id, "provide_token").seqs[0]
    if seq.seq_id not in engine._paused:
        raise ValueError(f"request_id={request_id!r} is not waiting for a token")
    vocab = engine.runtime.vocab_size
    if not (0 <= token_id < vocab):
        raise ValueError(f"token_id={token_id} is not allowed: must be in [0, {vocab})")
    del engine._paused[seq.seq_id]
    seq.append_token(int(token_id))
    if finish:
        engine.finish_sequence(seq, "stop")
    elif len(seq) >= engine.runtime.max_model_len:
        engine.finish_sequence(seq, "length")
    else:
        resume(engine, seq)


def reset_tokens(engine, request_id, token_ids: list[int]) -> None:
    """Make an external request's sequence hold exactly ``token_ids`` (its prompt first). The
    KV of the longest common prefix is kept (but for the last token, which is computed again so
    that the next step returns the logits after it), the rest is rolled back; the request runs
    again and pauses with those logits (a draft model's request after the target's
    verification).

    Raises:
        ValueError: not an open external request (or a beam search), ``token_ids`` does not
            start with its prompt, or is as long as ``max_model_len``.
    """
    req = _external_request(engine, request_id, "reset_tokens")
    seq, ids = req.seqs[0], list(token_ids)
    if ids[: seq.num_prompt_tokens] != req.prompt_token_ids:
        raise ValueError(
            f"token_ids is not allowed for request_id={request_id!r}: must start with its "
            f"prompt ({seq.num_prompt_tokens} tokens)"
        )
    max_len = engine.runtime.max_model_len
    if len(ids) >= max_len:
        raise ValueError(
            f"token_ids of {len(ids)} tokens is not allowed: must be < max_model_len={max_len}"
        )
    common = seq.num_prompt_tokens
    limit = min(len(seq), len(ids))
    while common < limit and seq.token_ids[common] == ids[common]:
        common += 1
    engine.scheduler.rollback(seq, common, num_computed=min(common, len(ids) - 1))
    seq.token_ids.extend(ids[common:])
    if engine._paused.pop(seq.seq_id, None) is not None:
        resume(engine, seq)  # a preempted (not paused) one stays in ``waiting``
