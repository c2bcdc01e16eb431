"""Assisted decoding calls of ``generate`` (``prompt_lookup_num_tokens=``, ``assistant_model=``)
on the engine's speculative steps.

Stock's ``_assisted_decoding`` keeps, each step, the candidates the model agrees with plus the
model's own next token, so its greedy output is the model's greedy output and its sampled output
has the model's distribution. The engine's speculative steps (``engine/spec/spec_decode.py``) keep the
same invariant for every row of a batch at once, so a prepared call runs as a native call whose
requests carry a proposer (attached by ``route.py``): ``NgramProposer`` for prompt lookup (stock takes it over an
assistant model when both are given), ``DraftModelProposer`` over the assistant model's own
engine otherwise, with the assistant's ``num_assistant_tokens``, its schedule and confidence
threshold (they change only speed).

Stock serves batch size 1 only (it raises for more rows); here any left-padded batch runs, each
row with its own number of kept tokens. What stays stock, each by a named ``Refusal``:
another tokenizer (universal assisted decoding), early exit, multi-token prediction heads and
other special assistants, ensemble verification (``assistant_ensemble_weight``, which changes
outputs), calls that observe every step (streamer, scores, user processors or criteria), and
stop strings (stock checks them once per step, after several tokens, so where it stops depends
on its step boundaries).
"""

from __future__ import annotations

import contextlib

from transformers.generation.stopping_criteria import StopStringCriteria

from hf_paged.integration.plan import SpecPlan
from hf_paged.integration.prepare import PreparedCall
from hf_paged.refusal import Refusal

# stock's global defaults for the assistant's generation config fields it leaves unset
_ASSISTANT_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}


def spec_plan(call: PreparedCall) -> SpecPlan | Refusal:
    """The proposer of an assisted call (``call.assisted``), or the ``Refusal`` of a kind of
    assisted decoding the engine does not serve."""
    gen = call.generation_config
    if call.observed:
        return Refusal(
            "assisted_observed",
            "assisted decoding whose steps are observed (streamer, scores, logits processors or "
            "stopping criteria)",
        )
    if getattr(gen, "assistant_early_exit", None) is not None:
        return Refusal(
            "assistant_early_exit", "assistant_early_exit drafts with the model's own layers"
        )
    if getattr(gen, "assistant_ensemble_weight", None) is not None:
        return Refusal(
            "assistant_ensemble_weight",
            "assistant_ensemble_weight verifies against a mix of both models",
        )
    if any(type(c) is StopStringCriteria for c in call.criteria):
        return Refusal(
            "assisted_stop_strings",
            "stop strings with assisted decoding (stock checks them once per multi-token step)",
        )
    if gen.prompt_lookup_num_tokens is not None:
        return SpecPlan(
            "ngram", int(gen.prompt_lookup_num_tokens), int(gen.max_matching_ngram_size or 2)
        )
    if getattr(gen, "use_mtp", None) or getattr(gen, "speculation_type", None) is not None:
        return Refusal("assisted_mtp", "multi-token prediction heads draft the candidates")
    assistant = call.assistant_model
    if type(assistant).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
        return Refusal("assisted_gemma4", f"{type(assistant).__name__} drafts from shared KV")
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


def assistant_refusal(assistant, hold_engine=None) -> Refusal | None:
    """Why the engine cannot draft with ``assistant``, before its engine is held: the engine
    cannot serve it (reason ``assistant_...``), or nobody holds an engine for an HF model."""
    import torch

    from hf_paged.integration import servable

    if isinstance(assistant, torch.nn.Module):
        refusal = servable.model_refusal(assistant)
        if refusal is not None:
            return refusal.renamed("assistant_", "the assistant: ")
        if hold_engine is None:
            return Refusal("assistant_model", "this caller holds no engine for an HF model")
        return None
    if not callable(getattr(assistant, "hold_engine", None)):  # a PagedModelForCausalLM has it
        return Refusal("assistant_model", f"{type(assistant).__name__} is not a model")
    return None


def draft_engine_refusal(draft, engine) -> Refusal | None:
    """Why the assistant's engine ``draft`` cannot draft for ``engine``: it is the model's own
    engine, or its vocabulary is not the model's."""
    if draft is engine:
        return Refusal("assisted_self", "assistant_model is the model itself")
    if draft.runtime.vocab_size != engine.runtime.vocab_size:
        return Refusal(
            "assistant_vocab",
            f"the assistant's vocabulary ({draft.runtime.vocab_size}) is not the model's "
            f"({engine.runtime.vocab_size})",
        )
    return None


@contextlib.contextmanager
def draft_proposer(plan: SpecPlan, assistant, engine, hold_engine=None):
    """A ``DraftModelProposer`` over the assistant's engine, held for the block: a
    ``PagedModelForCausalLM``'s, or an HF model's own paged engine through ``hold_engine``
    (``dispatch.hold_engine``: its ``configure`` options apply; on a GPU give the two engines
    memory shares that fit together). Yields the ``Refusal`` instead where
    ``draft_engine_refusal`` finds one (``assistant_refusal`` is asked first, by the caller).
    """
    import torch

    from hf_paged.engine.spec.proposers import DraftModelProposer

    if isinstance(assistant, torch.nn.Module):
        held = hold_engine(assistant)
    else:  # a PagedModelForCausalLM
        held = assistant.hold_engine()
    with held as draft:
        refusal = draft_engine_refusal(draft, engine)
        if refusal is not None:
            yield refusal
            return
        yield DraftModelProposer(draft, plan.num_tokens, plan.schedule, plan.confidence_threshold)
