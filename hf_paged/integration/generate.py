"""``generate(backend="paged")``: one HF ``generate`` call run on the paged engine.

The call is prepared with HF's own machinery (``prepare.py``), so defaults, validation errors
and the processors it builds are stock's by construction.

Then one of two paths:

* native: the processors and criteria are ones the engine's sampler implements (greedy or
  temperature/top-k/top-p/min-p sampling, repetition penalty, min length, EOS, max length) and the
  caller observes nothing per step (no user processors/criteria, streamer, scores or logits). Each
  row is an ordinary engine request; seeds for sampled rows come from torch's global RNG.
* external: every row is an external-sampling request. Each step gathers all open rows' raw
  logits into ``[B, V]`` and runs exactly stock ``_sample``'s loop body on it: processors,
  multinomial or argmax, pad for finished rows, stopping criteria, streamer.

An assisted call (``prompt_lookup_num_tokens``, ``assistant_model``) is a native call whose
requests carry a proposer (``assisted.py``): the engine verifies several proposed tokens per step.

Anything neither path can reproduce raises ``PagedFallback`` before the engine is touched (or
before any request is added), and the dispatcher runs stock ``generate`` instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers.generation import (
    GenerateDecoderOnlyOutput,
)

from hf_paged.config import SamplingParams
from hf_paged.engine.request import EngineRequest, RequestGroup, draw_seeds
from hf_paged.integration.assisted import proposer_for, spec_plan
from hf_paged.integration.prepare import (  # noqa: F401  (re-exported)
    PagedFallback,
    PreparedCall,
    check_fits,
    prepare_call,
)
from hf_paged.integration.sampling import NativePlan, native_plan


def generate_paged(
    model, get_engine: Callable[[], object], hold_draft_engine=None, **generate_kwargs
):
    """Run one ``generate`` call (stock's arguments, already bound by name) on the engine.

    Args:
        hold_draft_engine: ``assistant_model -> context manager yielding its engine``, for
            calls with an ``assistant_model`` (None: such calls fall back).

    Returns:
        What stock returns: the ``[B, L + T]`` sequences tensor, or a
        ``GenerateDecoderOnlyOutput`` (``cache=None``) with ``return_dict_in_generate``.

    Raises:
        PagedFallback: before any request is queued.
    """
    call = prepare_call(model, **generate_kwargs)
    spec = spec_plan(call) if call.assisted else None  # its fallbacks need no engine
    engine = get_engine()
    plan = plan_call(call, engine, spec)
    with torch.no_grad():
        if plan is not None:
            with proposer_for(plan.spec, call, engine, hold_draft_engine) as proposer:
                sequences = _run_native(engine, call, plan, proposer)
            scores = logits = None
        else:
            sequences, scores, logits = _run_external(engine, call)
    gen = call.generation_config
    if not gen.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, cache=None)


def plan_call(call: PreparedCall, engine, spec=None) -> NativePlan | None:
    """The engine-native plan of a prepared call (carrying ``spec``, an assisted call's
    proposer plan), or None when it must sample externally (a call that observes steps:
    streamer, scores, user processors or criteria).

    Raises:
        PagedFallback: the engine would cut a row short (or can't hold an external batch), or
            an assisted call needs processors the engine does not implement.
    """
    plan = None if call.observed else native_plan(call, engine.runtime.vocab_size)
    if spec is not None:  # speculative steps serve native plans only
        if plan is None:
            raise PagedFallback("assisted_processors", "assisted decoding with logits processors "
                                "or stopping criteria the engine does not implement")  # fmt: skip
        plan = dataclasses.replace(plan, spec=spec)
    check_fits(call, engine, native=plan is not None)
    return plan


def native_requests(call: PreparedCall, plan: NativePlan, proposer=None) -> list[EngineRequest]:
    """One engine request per row of ``call`` (rows repeated for ``num_return_sequences``);
    seeds for sampled rows are drawn now from torch's global RNG, as stock's sampling would."""
    seeds = draw_seeds(len(call.prompts), plan.temperature > 0)
    return [
        EngineRequest(p, plan.sampling_params(s), stop_strings=plan.stop_strings,
                      proposer=proposer)
        for p, s in zip(call.prompts, seeds, strict=True)
    ]  # fmt: skip


def native_sequences(call: PreparedCall, new: list[list[int]]) -> torch.Tensor:
    """Rows' new tokens -> stock's ``[B, L + T]`` sequences (rows that stopped early padded)."""
    n, width = len(new), max(len(t) for t in new)
    pad = call.pad_token_id if call.pad_token_id is not None else 0  # unequal only with an EOS
    ids = call.input_ids
    out = torch.full((n, ids.shape[1] + width), pad, dtype=ids.dtype, device=ids.device)
    out[:, : ids.shape[1]] = ids
    for i, toks in enumerate(new):
        out[i, ids.shape[1] : ids.shape[1] + len(toks)] = torch.tensor(toks, dtype=ids.dtype)
    return out


def _run_native(engine, call: PreparedCall, plan: NativePlan, proposer=None) -> torch.Tensor:
    """Engine-sampled rows -> ``[B, L + T]``."""
    outs = engine.run(native_requests(call, plan, proposer))
    return native_sequences(call, [out.outputs[0].token_ids for out in outs])


def _collect_logits(batch: RequestGroup, rids: list, budget: int) -> dict:
    """Step until every request in ``rids`` has its next-token logits; ``{rid: [V] float32}``."""
    want, got = set(rids), {}
    for _ in range(budget):
        if want <= got.keys():
            return got
        res = batch.step()
        for rid, row in res.logits.items():
            if rid in want:
                got[rid] = row  # a preempted request reports again: the same values
        ended = [r for r in want if r in batch.outputs]
        if ended:
            out = batch.outputs[ended[0]]
            raise RuntimeError(
                f"the engine ended request {ended[0]!r} itself "
                f"(finish_reason={out.outputs[0].finish_reason!r})"
            )
    if want <= got.keys():
        return got
    raise RuntimeError(f"the engine made no progress on {len(want - got.keys())} request(s)")


def _run_external(engine, call: PreparedCall):
    """Stock ``_sample``'s loop with the engine as the model: ``(sequences, scores, logits)``."""
    gen, input_ids = call.generation_config, call.input_ids  # [B, L]
    n, dev = input_ids.shape[0], input_ids.device
    pad = gen._pad_token_tensor
    pad = pad.to(dev) if pad is not None else None
    scores = () if gen.return_dict_in_generate and gen.output_scores else None
    raw_logits = () if gen.return_dict_in_generate and gen.output_logits else None
    has_eos = any(hasattr(c, "eos_token_id") for c in call.criteria)
    # stock keeps feeding finished rows pad tokens; only scores/logits and user processors
    # can tell, so otherwise a finished row (its tokens are pad from now on) leaves the engine
    feed_finished = call.wants_scores or call.user_processors
    unfinished = torch.ones(n, dtype=torch.long, device=dev)
    open_rows = list(range(n))
    params = SamplingParams(temperature=0.0, max_tokens=call.max_new_tokens)
    prompt_tokens = sum(len(p) for p in call.prompts)
    with engine.request_group() as batch:
        for prompt in call.prompts:
            batch.add(EngineRequest(prompt, params), external_sampling=True)
        if call.streamer is not None:
            call.streamer.put(input_ids.cpu())
        for step in range(call.max_new_tokens):
            # steps a round may take: every row recomputed once (preemption), plus slack
            budget = prompt_tokens + n * (step + 2) + 16
            next_token_logits = _gather_logits(batch, open_rows, n, budget).to(dev)  # [B, V]
            next_token_scores = call.processors(input_ids, next_token_logits)  # [B, V]
            if scores is not None:
                scores += (next_token_scores,)
            if raw_logits is not None:
                raw_logits += (next_token_logits,)
            next_tokens = _select(next_token_scores, gen.do_sample, open_rows)  # [B]
            if has_eos:
                next_tokens = next_tokens * unfinished + pad * (1 - unfinished)
            input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
            unfinished = unfinished & ~call.criteria(input_ids, scores)
            if call.streamer is not None:
                call.streamer.put(next_tokens.cpu())
            done = bool(unfinished.max() == 0)
            tokens = next_tokens.tolist()
            for i in list(open_rows):
                if done or (has_eos and not feed_finished and not unfinished[i]):
                    batch.close(batch.rids[i])  # its later tokens are pad: stop it
                    open_rows.remove(i)
                else:
                    engine.provide_token(batch.rids[i], tokens[i])
            if done:
                break
        for rid in batch.rids:  # a criteria list without max_length: stop where stock would
            batch.close(rid)
        batch.drain()
    if call.streamer is not None:
        call.streamer.end()
    return input_ids, scores, raw_logits


def _gather_logits(batch: RequestGroup, open_rows: list[int], n: int, budget: int) -> torch.Tensor:
    """``[B, V]`` raw next-token logits; rows no longer in the engine get zeros."""
    got = _collect_logits(batch, [batch.rids[i] for i in open_rows], budget)
    rows = [got.get(batch.rids[i]) for i in range(n)]
    zeros = torch.zeros_like(next(iter(got.values())))
    return torch.stack([r if r is not None else zeros for r in rows])


def _select(scores: torch.Tensor, do_sample: bool, open_rows: list[int]) -> torch.Tensor:
    """Stock's token choice on ``[B, V]`` processed scores: multinomial (torch's global RNG) or
    argmax. Rows that left the engine become pad afterwards; they draw from a valid uniform."""
    n = scores.shape[0]
    if len(open_rows) < n:
        closed = torch.ones(n, dtype=torch.bool, device=scores.device)
        closed[open_rows] = False
        scores = scores.masked_fill(closed[:, None], 0.0)
    if do_sample:
        probs = torch.nn.functional.softmax(scores, dim=-1)
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    return torch.argmax(scores, dim=-1)
