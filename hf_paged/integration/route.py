"""The one route of a paged ``generate`` call: prepare -> beams? -> speculation -> plan -> fit ->
requests. Every front end calls ``route`` and matches its result: ``paged_call.generate_paged``
(the dispatcher, ``PagedModelForCausalLM``) for one call, and the many-prompt front ends (the
streaming pipeline, ``paged_generate_map``, lm-eval's ``generate_until``) for each call whose
rows they run together with other calls' rows in one engine run.

A call goes one of three ways:

* ``Native``: the engine samples every row itself (the processors and criteria are ones its
  sampler implements and nobody observes a step); its rows are engine requests. Assisted
  decoding is a native call whose plan has a ``spec``: its requests carry a proposer, attached
  here and nowhere else.
* ``External``: stock ``_sample``'s loop body runs on the engine's logits (``external.py``).
* ``Beams``: stock ``_beam_search``'s loop body runs on the engine's forked beams
  (``beam_search.py``).

Every judgement on the way (``prepare_call``, ``beams_refusal``, ``spec_plan``, ``native_plan``,
``fit_refusal``, the assistant's, the rows' LoRA adapters) returns a ``Refusal`` where it is made; ``route`` is the one
boundary that raises it, as ``PagedFallback``, before a request is queued.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration.assisted import (
    assistant_refusal,
    draft_proposer,
    ngram_proposer,
    spec_plan,
)
from hf_paged.integration.beam_search import beams_refusal
from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.loras import lora_refusal
from hf_paged.integration.plan import NativePlan, PlanCache, SpecPlan, fit_refusal, native_plan
from hf_paged.integration.prepare import PreparedCall, prepare_call
from hf_paged.refusal import Refusal


@dataclass
class Native:
    """Rows the engine samples itself: their plan and their engine requests."""

    input_ids: torch.Tensor  # [B, L] as given (rows repeated for num_return_sequences)
    prompts: list[list[int]]  # per row: the attended tokens
    pad_token_id: int | None
    plan: NativePlan
    requests: list[EngineRequest] = field(default_factory=list)
    call: PreparedCall | None = None  # the prepared call (None: its plan came from a PlanCache)

    @property
    def spec(self) -> SpecPlan | None:
        """The proposer's plan when the call is assisted (speculative steps), else None."""
        return self.plan.spec

    def sequences(self, new: list[list[int]]) -> torch.Tensor:
        """Rows' new tokens -> stock's ``[B, L + T]`` (rows that stopped early padded)."""
        n, width = len(new), max(len(t) for t in new)
        pad = self.pad_token_id if self.pad_token_id is not None else 0  # unequal only with EOS
        ids = self.input_ids
        # stock appends int64 tokens with torch.cat, which promotes narrower prompt ids
        dtype = torch.promote_types(ids.dtype, torch.long)
        out = torch.full((n, ids.shape[1] + width), pad, dtype=dtype, device=ids.device)
        out[:, : ids.shape[1]] = ids
        for i, toks in enumerate(new):
            out[i, ids.shape[1] : ids.shape[1] + len(toks)] = torch.tensor(toks, dtype=dtype)
        return out


@dataclass
class External:
    """A call that samples outside the engine, step by step (``external.run_external``)."""

    call: PreparedCall


@dataclass
class Beams:
    """A ``num_beams > 1`` call: beam search or beam sampling (``beam_search.generate_beams``)."""

    call: PreparedCall


@dataclass(frozen=True)
class DraftHold:
    """What lets a route hold an assistant model's engine for one call (``generate_paged``)."""

    stack: contextlib.ExitStack  # the assistant's engine is held until the stack closes
    engine: Callable[[], object]  # the model's own engine
    hold_engine: Callable | None = None  # HF model -> context manager yielding its engine


def route(
    model,
    generate_kwargs: dict,
    engine_of: Callable[[], object],
    *,
    cache: PlanCache | None = None,
    drafts: DraftHold | None = None,
) -> Native | External | Beams:
    """The way one ``generate`` call (stock's arguments, bound by name) runs on the engine.

    Args:
        model: what stock's preparation runs on (the HF model, or a meta-device skeleton).
        generate_kwargs: the call's arguments (``adapter_names``: each row's LoRA adapter, as
            ``PeftModel.generate`` takes them; ``loras.lora_refusal``).
        engine_of: returns the engine; called once the call is prepared and its engine-free
            refusals are passed, so a call stock rejects builds no engine.
        cache: plans of earlier calls that differed only in their prompt (many-prompt front
            ends); a hit skips the preparation.
        drafts: where an assistant model's engine is held; without it an assistant model is
            refused (its engine is held for one call at a time).

    Raises:
        PagedFallback: the call needs stock ``generate``, or a row would not fit the engine (the
            one place a call's ``Refusal`` is raised).
        ValueError / TypeError: what stock raises for the same arguments.
    """
    kwargs = dict(generate_kwargs)
    adapter_names = kwargs.pop("adapter_names", None)  # as ``PeftModel.generate`` takes them
    routed = _route(model, kwargs, engine_of, cache, drafts)
    if not isinstance(routed, Refusal):  # each row's LoRA adapter, where the model has some
        routed = lora_refusal(model, engine_of, routed, adapter_names) or routed
    if isinstance(routed, Refusal):
        raise PagedFallback.of(routed)
    return routed


def _route(model, generate_kwargs, engine_of, cache, drafts) -> Native | External | Beams | Refusal:
    key = cache.key(generate_kwargs, model) if cache is not None else None
    hit = cache.get(key) if key is not None else None
    if hit is not None:
        plan, rows_per_input, pad = hit
        ids = generate_kwargs["input_ids"].repeat_interleave(rows_per_input, dim=0)
        embeds, ranges = _cached_plan_images(model, generate_kwargs, rows_per_input, engine_of)
        return _native(ids, ids.tolist(), pad, plan, engine_of(), embeds=embeds, ranges=ranges)
    call = prepare_call(model, **generate_kwargs)
    if isinstance(call, Refusal):
        return call
    refusal = _recurrent_refusal(model, call)
    if refusal is not None:
        return refusal
    if call.mm_inputs is not None:  # images: each row's features, from the engine's cache
        call.prompt_embeds = _image_embeds(model, call, engine_of().runtime)
        call.bidirectional_ranges = _image_ranges(model, call)
    if call.from_inputs_embeds and (call.beams or call.assisted):
        return Refusal("inputs_embeds", "inputs_embeds with beam search or assisted decoding")
    if call.beams:
        return beams_refusal(call, engine_of()) or Beams(call)
    spec = spec_plan(call) if call.assisted else None  # its refusals need no engine
    if isinstance(spec, Refusal):
        return spec
    if spec is not None and spec.kind == "draft" and drafts is None:
        return Refusal("assisted_rows", "an assistant model drafts for one generate call at a time")
    engine = engine_of()
    # inputs_embeds: stock's processors see its ids ([B, 0] or the caller's), not the engine's
    # placeholders, so its loop body runs on the engine's logits
    plan = None if call.from_inputs_embeds else native_plan(call, engine.runtime.vocab_size)
    if plan is None or isinstance(plan, Refusal):
        if spec is not None:  # speculative steps serve native plans only
            return Refusal(
                "assisted_processors", "assisted decoding with logits processors or stopping "
                "criteria the engine does not implement",
            )  # fmt: skip
        return fit_refusal(call.prompts, call.max_new_tokens, engine.runtime, held="batch") or (
            External(call)
        )
    if spec is not None:
        plan = dataclasses.replace(plan, spec=spec)
    native = _native(
        call.input_ids, call.prompts, call.pad_token_id, plan, engine, call.assistant_model, drafts,
        call.prompt_embeds, call.bidirectional_ranges,
    )  # fmt: skip
    if isinstance(native, Refusal):
        return native
    native.call = call
    if key is not None:
        rows_per_input = len(call.prompts) // generate_kwargs["input_ids"].shape[0]
        cache.put(key, (native.plan, rows_per_input, call.pad_token_id))
    return native


def _native(input_ids, prompts, pad_token_id, plan: NativePlan, engine, assistant=None,
            drafts: DraftHold | None = None, embeds: list | None = None,
            ranges: list | None = None) -> Native | Refusal:  # fmt: skip
    """The rows' requests, with the plan's proposer if it has one. Seeds for sampled rows are
    drawn now from torch's global RNG (so ``torch.manual_seed`` reproduces a call, as it does
    stock's)."""
    refusal = fit_refusal(prompts, plan.max_tokens, engine.runtime, held="rows")
    if refusal is not None:
        return refusal
    n = len(prompts)
    seeds = torch.randint(0, 2**62, (n,)).tolist() if plan.temperature > 0 else [None] * n
    matcher = plan.stop_strings
    embeds = embeds if embeds is not None else [None] * n
    ranges = ranges if ranges is not None else [None] * n
    requests = [
        EngineRequest(p, plan.sampling_params(s), stop_strings=matcher, prompt_embeds=e,
                      bidirectional_ranges=r)
        for p, s, e, r in zip(prompts, seeds, embeds, ranges, strict=True)
    ]  # fmt: skip
    native = Native(input_ids, prompts, pad_token_id, plan, requests)
    if plan.spec is not None:
        refusal = _attach_proposer(native, assistant, drafts)
        if refusal is not None:
            return refusal
    return native


def _attach_proposer(native: Native, assistant, drafts: DraftHold | None) -> Refusal | None:
    """Give every request the call's proposer: prompt lookup's (state per sequence), or one over
    the assistant model's engine, held on ``drafts.stack`` until the call ends; or the
    ``Refusal`` of an assistant the engine cannot draft with."""
    spec = native.spec
    if spec.kind == "ngram":
        proposer = ngram_proposer(spec)
    else:
        refusal = assistant_refusal(assistant, drafts.hold_engine)
        if refusal is not None:
            return refusal
        proposer = drafts.stack.enter_context(
            draft_proposer(spec, assistant, drafts.engine(), drafts.hold_engine)
        )
        if isinstance(proposer, Refusal):
            return proposer
    for r in native.requests:
        r.proposer = proposer
    return None


def _image_embeds(model, call: PreparedCall, runtime) -> list:
    """Each row's ``PromptEmbeds`` (``integration/multimodal``), repeated as the call's rows
    are (``num_return_sequences``, beams): one encoder pass per distinct image."""
    from hf_paged.integration.multimodal import prompt_embeds

    per_input = prompt_embeds(model, call.mm_input_ids, call.mm_attention_mask, call.mm_inputs,
                              runtime.encoder_cache)  # fmt: skip
    repeat = len(call.prompts) // len(per_input)
    return [e for e in per_input for _ in range(repeat)]


def _cached_plan_images(model, generate_kwargs: dict, repeat: int, engine_of):
    """``(prompt embeds, bidirectional ranges)`` per row of a call whose plan came from the
    cache (unpadded rows), from its own image inputs; ``(None, None)`` without any."""
    from hf_paged.integration import multimodal
    from hf_paged.integration.multimodal.image_blocks import row_ranges

    if not multimodal.is_multimodal(model):
        return None, None
    keys = multimodal.multimodal_keys(model)
    mm = {k: v for k, v in generate_kwargs.items() if k in keys and v is not None}
    if not mm:
        return None, None
    ids = generate_kwargs["input_ids"]
    mask = torch.ones_like(ids)
    embeds = multimodal.prompt_embeds(model, ids, mask, mm, engine_of().runtime.encoder_cache)
    ranges = row_ranges(model, mask, mm)
    embeds = [e for e in embeds for _ in range(repeat)]
    return embeds, None if ranges is None else [r for r in ranges for _ in range(repeat)]


def _image_ranges(model, call: PreparedCall) -> list | None:
    """Each row's bidirectional ranges (``integration/multimodal/image_blocks.py``), repeated
    as the call's rows are; None for a causal family."""
    from hf_paged.integration.multimodal.image_blocks import row_ranges

    per_input = row_ranges(model, call.mm_attention_mask, call.mm_inputs)
    if per_input is None:
        return None
    repeat = len(call.prompts) // len(per_input)
    return [r for r in per_input for _ in range(repeat)]


def _recurrent_refusal(model, call) -> Refusal | None:
    """Beams and assisted decoding of a model with recurrent layers run stock: a beam would
    copy its state at every fork, and a rejected speculative token cannot be taken back out of
    a recurrent state."""
    if not (call.beams or call.assisted):
        return None
    from hf_paged.models.recurrent.registry import recurrent_modules

    found = recurrent_modules(model)
    if not found:
        return None
    layer = type(found[0][1]).__name__
    if call.beams:
        return Refusal(
            "recurrent_beams",
            f"beam search on a model with recurrent layers ({layer}) is not served paged yet",
        )
    return Refusal(
        "recurrent_assisted",
        f"assisted decoding on a model with recurrent layers ({layer}): a recurrent state "
        "cannot take back rejected speculative tokens",
    )


__all__ = ["Beams", "DraftHold", "External", "Native", "route"]
