"""Assisted decoding calls of ``generate`` (``prompt_lookup_num_tokens=``, ``assistant_model=``)
on the engine's speculative steps.

Stock's ``_assisted_decoding`` keeps, each step, the candidates the model agrees with plus the
model's own next token, so its greedy output is the model's greedy output and its sampled output
has the model's distribution. The engine's speculative steps (``engine/spec/spec_decode.py``) keep the
same invariant for every row of a batch at once, so a prepared call runs as a native call whose
requests carry a proposer: ``NgramProposer`` for prompt lookup (stock takes it over an
assistant model when both are given), ``DraftModelProposer`` over the assistant model's own
engine otherwise, with the assistant's ``num_assistant_tokens``, its schedule and confidence
threshold (they change only speed).

Stock serves batch size 1 only (it raises for more rows); here any left-padded batch runs, each
row with its own number of kept tokens. What stays stock, each by a named ``PagedFallback``:
another tokenizer (universal assisted decoding), early exit, multi-token prediction heads and
other special assistants, ensemble verification (``assistant_ensemble_weight``, which changes
outputs), calls that observe every step (streamer, scores, user processors or criteria), and
stop strings (stock checks them once per step, after several tokens, so where it stops depends
on its step boundaries).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from transformers.generation.stopping_criteria import StopStringCriteria

from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.prepare import PreparedCall

# stock's global defaults for the assistant's generation config fields it leaves unset
_ASSISTANT_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}


@dataclass(frozen=True)
class SpecPlan:
    """The proposer of an assisted call."""

    kind: str  # "ngram" (prompt lookup) or "draft" (assistant model)
    num_tokens: int  # prompt_lookup_num_tokens / num_assistant_tokens
    max_matching_ngram_size: int = 2  # ngram
    schedule: str = "constant"  # draft: num_assistant_tokens_schedule
    confidence_threshold: float | None = None  # draft: assistant_confidence_threshold


def spec_plan(call: PreparedCall) -> SpecPlan:
    """The proposer of an assisted call (``call.assisted``).

    Raises:
        PagedFallback: a kind of assisted decoding the engine does not serve.
    """
    gen = call.generation_config
    if call.observed:
        raise PagedFallback(
            "assisted_observed",
            "assisted decoding whose steps are observed (streamer, scores, logits processors or "
            "stopping criteria)",
        )
    if getattr(gen, "assistant_early_exit", None) is not None:
        raise PagedFallback(
            "assistant_early_exit", "assistant_early_exit drafts with the model's own layers"
        )
    if getattr(gen, "assistant_ensemble_weight", None) is not None:
        raise PagedFallback(
            "assistant_ensemble_weight",
            "assistant_ensemble_weight verifies against a mix of both models",
        )
    if any(type(c) is StopStringCriteria for c in call.criteria):
        raise PagedFallback(
            "assisted_stop_strings",
            "stop strings with assisted decoding (stock checks them once per multi-token step)",
        )
    if gen.prompt_lookup_num_tokens is not None:
        return SpecPlan(
            "ngram", int(gen.prompt_lookup_num_tokens), int(gen.max_matching_ngram_size or 2)
        )
    if getattr(gen, "use_mtp", None) or getattr(gen, "speculation_type", None) is not None:
        raise PagedFallback("assisted_mtp", "multi-token prediction heads draft the candidates")
    assistant = call.assistant_model
    if type(assistant).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
        raise PagedFallback("assisted_gemma4", f"{type(assistant).__name__} drafts from shared KV")
    agen = assistant.generation_config
    value = {k: getattr(agen, k, None) for k in _ASSISTANT_DEFAULTS}
    value = {k: _ASSISTANT_DEFAULTS[k] if v is None else v for k, v in value.items()}
    return SpecPlan(
        "draft",
        int(value["num_assistant_tokens"]),
        schedule=str(value["num_assistant_tokens_schedule"]),
        confidence_threshold=float(value["assistant_confidence_threshold"]) or None,
    )


def ngram_proposer(plan: SpecPlan):
    """A prompt-lookup proposer for one call's requests (its state is per sequence)."""
    from hf_paged.engine.spec.proposers import NgramProposer

    return NgramProposer(plan.num_tokens, plan.max_matching_ngram_size)


@contextlib.contextmanager
def draft_proposer(plan: SpecPlan, assistant, engine, hold_engine=None):
    """A ``DraftModelProposer`` over the assistant's engine, held for the block: a
    ``PagedModelForCausalLM``'s, or an HF model's own paged engine through ``hold_engine``
    (``dispatch.hold_engine``: its ``configure`` options apply; on a GPU give the two engines
    memory shares that fit together).

    Raises:
        PagedFallback: the engine cannot serve the assistant (reason ``assistant_...``), it is
            the model's own engine, or its vocabulary is not the model's.
    """
    import torch

    from hf_paged.engine.spec.proposers import DraftModelProposer
    from hf_paged.integration import servable

    if isinstance(assistant, torch.nn.Module):
        fb = servable.model_reason(assistant)
        if fb is not None:
            raise PagedFallback(f"assistant_{fb.reason}", f"the assistant: {fb.detail}")
        if hold_engine is None:
            raise PagedFallback("assistant_model", "this caller holds no engine for an HF model")
        held = hold_engine(assistant)
    elif callable(getattr(assistant, "hold_engine", None)):  # a PagedModelForCausalLM
        held = assistant.hold_engine()
    else:
        raise PagedFallback("assistant_model", f"{type(assistant).__name__} is not a model")
    with held as draft:
        if draft is engine:
            raise PagedFallback("assisted_self", "assistant_model is the model itself")
        if draft.runtime.vocab_size != engine.runtime.vocab_size:
            raise PagedFallback(
                "assistant_vocab",
                f"the assistant's vocabulary ({draft.runtime.vocab_size}) is not the model's "
                f"({engine.runtime.vocab_size})",
            )
        yield DraftModelProposer(draft, plan.num_tokens, plan.schedule, plan.confidence_threshold)
