"""One paged ``generate`` call, run: ``route`` -> run its way on the engine -> stock's outputs.

The dispatcher and ``PagedModelForCausalLM`` call ``generate_paged``; the many-prompt front ends
take the same ``route`` (``route.py``) for each call and run the rows of many calls in one engine
run. The call is prepared with HF's own machinery (``prepare.py``), so defaults, validation
errors and the processors it builds are stock's by construction; then it runs one of three ways:

* ``Native`` (``plan.py``): each row is an ordinary engine request; an assisted call's requests
  carry a proposer (``assisted.py``) and the engine verifies several proposed tokens a step.
* ``External`` (``external.py``): stock ``_sample``'s loop body on the engine's logits.
* ``Beams`` (``beam_search.py``): stock ``_beam_search``'s loop body on the engine's forked beams.

Around each way, the cache stock returns and takes (``contract/cache.py``): a cache passed in is
checked against the engine's KV first, and stock's cache object is filled from the engine's KV
blocks after the run, when the output returns it or the caller passed it.

Anything none of them can reproduce is a ``Refusal``, raised by ``route`` (the call) or here (its
cache duties) as ``PagedFallback`` before the call's requests are queued.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from hf_paged.integration.beam_search import generate_beams
from hf_paged.integration.contract.cache import cache_contract, output_field, take_passed_cache
from hf_paged.integration.contract.content import fill, passed_cache_refusal
from hf_paged.integration.external import run_external
from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.route import Beams, DraftHold, External, Native, route
from hf_paged.refusal import Refusal


def generate_paged(model, get_engine: Callable[[], object], hold_assistant=None, **generate_kwargs):
    """Run one ``generate`` call (stock's arguments, bound by name) on the engine.

    Args:
        model: what stock's preparation runs on (the HF model, or a meta-device skeleton).
        get_engine: builds or returns the engine (called once the call is prepared, so a call
            stock rejects builds nothing).
        hold_assistant: ``HF model -> context manager yielding its engine`` (the dispatcher's
            ``hold_engine``), for an ``assistant_model`` that is an HF model.

    Returns:
        What stock returns: the ``[B, L + T]`` sequences tensor, or a
        ``GenerateDecoderOnlyOutput`` with ``return_dict_in_generate`` (a
        ``GenerateBeamDecoderOnlyOutput`` for beams), its cache stock's
        (``contract/cache.py``). A cache passed in is filled in place, as stock fills it.

    Raises:
        PagedFallback: before any request is queued.
    """
    engine = functools.cache(get_engine)  # built once, when the route first needs it
    passed = take_passed_cache(generate_kwargs)
    # the stack holds an assistant model's engine for the call
    with torch.no_grad(), contextlib.ExitStack() as stack:
        drafts = DraftHold(stack, engine, hold_assistant)
        routed = route(model, generate_kwargs, engine, drafts=drafts)
        contract = cache_contract(model, routed.call, passed, engine)
        if not isinstance(contract, Refusal):
            contract = passed_cache_refusal(contract, engine(), routed.call) or contract
        if isinstance(contract, Refusal):  # the call's cache duties: the boundary raises them
            raise PagedFallback.of(contract)
        match routed:
            case Beams(call):  # beam search / beam sampling
                return generate_beams(model, engine(), call, contract)
            case External(call):
                sequences, scores, logits = run_external(engine(), call)
            case Native():
                outs = engine().run(routed.requests)
                sequences = routed.sequences([o.token_ids for o in outs])
                scores = logits = None
        cache = fill(contract, engine(), sequences, routed.call)
    if not routed.call.generation_config.return_dict_in_generate:
        return sequences
    fields = {output_field(): cache}  # transformers 5.17 names it past_key_values, 5.24 cache
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **fields)


__all__ = ["generate_paged"]
