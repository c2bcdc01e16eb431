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

Anything none of them can reproduce raises ``PagedFallback`` before the call's requests are
queued.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from hf_paged.integration.beam_search import generate_beams
from hf_paged.integration.contract.cache import (
    cache_contract,
    check_passed,
    fill,
    output_field,
    take_passed_cache,
)
from hf_paged.integration.external import run_external
from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.plan import PlanCache
from hf_paged.integration.prepare import PreparedCall
from hf_paged.integration.route import Beams, DraftHold, External, Native, route
from hf_paged.models.adapters import peft_lora


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
        way = route(model, generate_kwargs, lambda: engine().runtime, drafts=drafts)
        contract = cache_contract(model, way.call, passed, engine)
        assign_loras(model, engine, way)
        if isinstance(way, Beams):  # beam search / beam sampling
            return generate_beams(model, engine(), way.call, contract)
        check_passed(contract, engine(), way.call)
        if isinstance(way, External):
            sequences, scores, logits = run_external(engine(), way.call)
        else:
            outs = engine().run(way.requests)
            sequences, scores, logits = way.sequences([o.token_ids for o in outs]), None, None
        cache = fill(contract, engine(), sequences, way.call)
    if not way.call.generation_config.return_dict_in_generate:
        return sequences
    fields = {output_field(): cache}  # transformers 5.17 names it past_key_values, 5.24 cache
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits, **fields)


def assign_loras(model, engine: Callable[[], object], way, adapter_names=None) -> None:
    """Give each row of ``way`` the LoRA adapter PEFT's forward would apply to it: an in-memory
    PEFT model served from LoRA slots (``models/adapters/peft_lora.py``) registers the call's
    adapters with its engine and sets the rows' keys. Nothing for a model without adapters.

    Args:
        adapter_names: per row, from a front end that runs the rows itself (the pipeline's
            ``generate_kwargs``); None = what ``PeftModel.generate`` hung on the model, if any.

    Raises:
        ValueError: stock's, for unknown names or ``adapter_names`` of another length than the
            forward's rows.
        PagedFallback: per-row ``adapter_names`` on an engine without slots (merged adapters),
            or an adapter the slots can't take (its rank grew past them).
    """
    if "peft" not in sys.modules:
        return
    layers = peft_lora.lora_layers(model)  # one walk over the model's modules per call
    if not layers:
        return
    if adapter_names is not None:
        adapter_names = peft_lora.checked_names(model, adapter_names, layers)
    named = adapter_names is not None or peft_lora.adapter_names_of(model, layers) is not None
    if engine().lora is None:
        if named:
            raise PagedFallback("peft_adapter_names", "per-row adapter_names on an engine that "
                                "merged its adapters (tensor parallelism)")  # fmt: skip
        return
    rows = len(way.requests) if isinstance(way, Native) else len(way.call.prompts)
    keys, made = [], {}
    for adapter in peft_lora.row_adapters(model, rows, adapter_names, layers):
        if adapter is not None and id(adapter) not in made:
            try:
                made[id(adapter)] = engine().add_lora(adapter)
            except ValueError as e:
                raise PagedFallback("lora_slots", str(e)) from None
        keys.append(None if adapter is None else made[id(adapter)])
    if isinstance(way, Native):
        for r, key in zip(way.requests, keys, strict=True):
            r.lora_key = key
    else:
        way.call.lora_keys = keys


def active_lora_key(model, engine) -> str | None:
    """The engine key of the adapters PEFT's forward applies to every row of ``model`` (its
    active adapters), for front ends that build their own requests (lm-eval); None without
    LoRA slots or adapters."""
    if "peft" not in sys.modules or engine.lora is None or not engine.lora.spec.from_peft:
        return None
    adapter = peft_lora.row_adapters(model, 1)[0]
    return None if adapter is None else engine.add_lora(adapter)


# the many-prompt front ends' names for the route (pipeline/streaming.py, lm_eval/generate_until.py)
NativeCall = Native


def plan_generate(model, runtime, generate_kwargs: dict, cache: PlanCache | None = None,
                  engine=None):  # fmt: skip
    """``route`` for a front end that runs the rows itself: the ``Native`` rows, or the
    ``PreparedCall`` of a call that must run another way (through ``generate`` itself). With
    ``engine``, the rows get their LoRA adapters (``assign_loras``; ``adapter_names`` in
    ``generate_kwargs`` as ``PeftModel.generate`` takes it)."""
    kwargs = dict(generate_kwargs)
    names = kwargs.pop("adapter_names", None)
    way = route(model, kwargs, lambda: runtime, cache=cache)
    if isinstance(way, Native) and engine is not None:
        assign_loras(model, lambda: engine, way, names)
    return way if isinstance(way, Native) else way.call


__all__ = [
    "NativeCall", "PlanCache", "PreparedCall", "generate_paged", "plan_generate",
]  # fmt: skip
