"""One paged ``generate`` call: prepare -> plan -> fit -> requests -> run -> stock's outputs.

Every front end goes through here: the ``generate`` dispatcher and ``PagedModelForCausalLM``
(``generate_paged``: one call), and the many-prompt front ends, the streaming pipeline,
``paged_generate_map`` and lm-eval's ``generate_until`` (``plan_generate``: one call's rows as
engine requests, which the front end runs together with other calls' rows in one engine run).

The call is prepared with HF's own machinery (``prepare.py``), so defaults, validation errors and
the processors it builds are stock's by construction. Then one of two paths:

* native (``plan.py``): the processors and criteria are ones the engine's sampler implements and
  the caller observes nothing per step; each row is an ordinary engine request.
* external (``external.py``): stock ``_sample``'s loop body on the engine's logits, step by step.

A ``num_beams > 1`` call (beam search, beam sampling) runs stock ``_beam_search``'s loop body on
the engine's forked beams instead (``beam_search.py``).

An assisted call (``prompt_lookup_num_tokens``, ``assistant_model``) is a native call whose
requests carry a proposer (``assisted.py``): the engine verifies several proposed tokens a step.

Anything neither path can reproduce raises ``PagedFallback`` before a request is queued.

``PlanCache`` serves the many-prompt front ends: calls whose plan cannot depend on the prompt
beyond its length are prepared once per distinct set of options, not once per prompt.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from transformers.generation import GenerateDecoderOnlyOutput

from hf_paged.integration.assisted import draft_proposer, spec_plan
from hf_paged.integration.beam_search import generate_beams
from hf_paged.integration.external import run_external
from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.plan import NativeCall, NativePlan, plan_call
from hf_paged.integration.prepare import PreparedCall, prepare_call


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
        ``GenerateDecoderOnlyOutput`` (no cache) with ``return_dict_in_generate`` (a
        ``GenerateBeamDecoderOnlyOutput`` for beams).

    Raises:
        PagedFallback: before any request is queued.
    """
    call = prepare_call(model, **generate_kwargs)
    _check_recurrent(model, call)
    if call.beams:  # beam search / beam sampling
        return generate_beams(model, get_engine(), call)
    spec = spec_plan(call) if call.assisted else None  # its fallbacks need no engine
    engine = get_engine()
    native = plan_call(call, engine.runtime, spec=spec)
    with torch.no_grad():
        if native is not None:
            with contextlib.ExitStack() as stack:
                if spec is not None and spec.kind == "draft":
                    proposer = stack.enter_context(
                        draft_proposer(spec, call.assistant_model, engine, hold_assistant)
                    )
                    for r in native.requests:
                        r.proposer = proposer
                outs = engine.run(native.requests)
            sequences, scores, logits = native.sequences([o.token_ids for o in outs]), None, None
        else:
            sequences, scores, logits = run_external(engine, call)
    gen = call.generation_config
    if not gen.return_dict_in_generate:
        return sequences
    # no cache field: transformers 5.17 names it past_key_values, 5.24 cache; both default None
    return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)


def _check_recurrent(model, call: PreparedCall) -> None:
    """Beams and assisted decoding of a model with recurrent layers run stock: a beam would
    copy its state at every fork, and a rejected speculative token cannot be taken back out of
    a recurrent state.

    Raises:
        PagedFallback: such a call.
    """
    if not (call.beams or call.assisted):
        return
    from hf_paged.models.recurrent.registry import recurrent_modules

    found = recurrent_modules(model)
    if not found:
        return
    layer = type(found[0][1]).__name__
    if call.beams:
        raise PagedFallback(
            "recurrent_beams",
            f"beam search on a model with recurrent layers ({layer}) is not served paged yet",
        )
    raise PagedFallback(
        "recurrent_assisted",
        f"assisted decoding on a model with recurrent layers ({layer}): a recurrent state "
        "cannot take back rejected speculative tokens",
    )


def plan_generate(model, runtime, generate_kwargs: dict, cache: PlanCache | None = None):
    """One call's rows for a many-prompt front end: a ``NativeCall`` (its engine requests made),
    or the ``PreparedCall`` when it must sample externally (the front end then runs it another
    way, e.g. through ``generate`` itself).

    Raises:
        PagedFallback: the call needs stock ``generate``, or a row would not fit the engine.
        ValueError / TypeError: what stock raises for the same arguments.
    """
    key = cache.key(generate_kwargs, model) if cache is not None else None
    hit = cache.get(key) if key is not None else None
    if hit is not None:
        plan, rows_per_input, pad = hit
        ids = generate_kwargs["input_ids"].repeat_interleave(rows_per_input, dim=0)
        rows = NativeCall(ids, ids.tolist(), pad, plan)
        return plan_call(rows, runtime, plan)
    call = prepare_call(model, **generate_kwargs)
    if call.beams:  # one generate call of its own (beam_search.py)
        return call
    spec = spec_plan(call) if call.assisted else None
    if spec is not None and spec.kind == "draft":
        raise PagedFallback(
            "assisted_rows", "an assistant model drafts for one generate call at a time"
        )
    native = plan_call(call, runtime, spec=spec)
    if native is None:
        return call
    if key is not None:
        rows_per_input = len(call.prompts) // generate_kwargs["input_ids"].shape[0]
        cache.put(key, (native.plan, rows_per_input, call.pad_token_id))
    return native


_SIMPLE = (int, float, str, bool, type(None))


class PlanCache:
    """Plans of calls that differ only in their prompt, keyed by everything else.

    Only unpadded calls with a length limit (``max_new_tokens``, or ``max_length``, keyed as
    ``max_length - L``) and no absolute ``min_length``, whose options are plain values, qualify:
    then stock's processors and criteria depend on the prompt only through its width L, and every
    length they hold is L plus a constant (max_length = L + max_new_tokens, min new tokens), which
    the plan stores as the constant. Stop strings see no pads in such rows, whatever L is.
    """

    def __init__(self):
        self._plans: dict[tuple, tuple[NativePlan, int, int | None]] = {}

    def key(self, kwargs: dict, model) -> tuple | None:
        """The call's key, or None when it must be prepared on its own."""
        ids = kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        if ids is None or (mask is not None and not bool(mask.all())):
            return None
        if kwargs.get("max_new_tokens") is None and kwargs.get("max_length") is None:
            return None
        if kwargs.get("min_length") or getattr(model.generation_config, "min_length", 0):
            return None
        items = []
        for k, v in sorted(kwargs.items()):
            if k in ("input_ids", "attention_mask"):
                continue
            if k == "max_length" and isinstance(v, int):
                v = ("relative", v - ids.shape[1])
            if isinstance(v, _SIMPLE) or (
                isinstance(v, (list, tuple)) and all(isinstance(x, _SIMPLE) for x in v)
            ):
                items.append((k, repr(v)))
            elif k == "tokenizer":  # the same object for the whole run (stop strings)
                items.append((k, id(v)))
            else:  # a GenerationConfig, processors, criteria, a streamer: prepare every call
                return None
        return (ids.shape[0], tuple(items))

    def get(self, key: tuple):
        return self._plans.get(key)

    def put(self, key: tuple, value: tuple) -> None:
        self._plans[key] = value


__all__ = ["NativeCall", "PlanCache", "PreparedCall", "generate_paged", "plan_generate"]
