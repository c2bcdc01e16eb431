"""The engine an lm-eval run uses, sized from what the run needs, and the one engine run that
serves all of a call's requests."""

from __future__ import annotations

import dataclasses

from tqdm.auto import tqdm

from hf_paged.config import EngineConfig
from hf_paged.engine.runtime import default_max_model_len, rope_length_limit
from hf_paged.integration import dispatch, servable
from hf_paged.refusal import Refusal


def is_active(lm) -> bool:
    """This HFLM's calls run paged: the ``hf-paged`` model, or the process is switched to the
    paged backend (``hf-paged run``, ``HF_PAGED_BACKEND=paged``, ``set_default_backend``)."""
    return getattr(lm, "always_paged", False) or dispatch.get_default_backend() == "paged"


def served_refusal(lm) -> Refusal | None:
    """Why the HFLM or its model is something the engine does not reproduce, or None."""
    if lm.backend != "causal":
        return Refusal("seq2seq", f"the model is {lm.backend}, not a causal decoder")
    if lm.world_size > 1:
        return Refusal("data_parallel", f"lm-eval runs {lm.world_size} ranks")
    if getattr(lm, "mixed_precision_dtype", None) is not None:
        return Refusal("autocast", f"mixed_precision_dtype={lm.mixed_precision_dtype}")
    return servable.generate_refusal(lm.model, {}, {})


# prompt-scoring steps: long prompts run in fewer, larger steps (evaluation/results/
# prompt_logprobs_*.json on the H200: 8,192-token steps 123k prompt tokens/s, 16,384 272k)
SCORING_BATCHED_TOKENS = 16384


def owner_for(lm, max_model_len: int, scoring: bool = False):
    """The engine owner of ``lm``'s model, configured so that its engine holds
    ``max_model_len`` tokens (what the run's longest request needs); or the ``Refusal`` of an
    HFLM, model or length the engine does not serve.

    An engine already built with room enough is kept; otherwise the model's engine config
    (``hf_paged.configure``) is raised to ``max_model_len`` before the next build, so a run
    builds one engine, never one at the model's default and then another. The model's own
    positions are the floor: stock never feeds more, and a later call may need them.
    ``scoring`` (loglikelihood requests): an engine still to be built, on options the user did
    not set, takes steps of ``SCORING_BATCHED_TOKENS``.
    """
    refusal = served_refusal(lm)
    if refusal is not None:
        return refusal
    too_long = rope_length_limit(lm.model.config, max_model_len)
    if too_long is not None:
        return Refusal("rope_length", too_long)
    owner = dispatch.owner(lm.model)
    want = owner.configured or owner.built_with or EngineConfig()
    if owner.engine is not None:
        room = owner.engine.runtime.max_model_len
    else:
        room = want.max_model_len or default_max_model_len(lm.model.config)
    changes = {}
    if room < max_model_len:
        changes["max_model_len"] = max_model_len
    if (scoring and owner.engine is None and owner.configured is None
            and want.max_num_batched_tokens < SCORING_BATCHED_TOKENS):  # fmt: skip
        changes["max_num_batched_tokens"] = SCORING_BATCHED_TOKENS
    if changes:
        owner.configure(dataclasses.replace(want, **changes))
    return owner


def run_requests(engine, requests: list, desc: str, disable: bool) -> list:
    """One engine run over every ``EngineRequest``; RequestOutputs in input order.

    At most ``4 * max_num_seqs`` requests are in the engine at once: more cannot run in the
    next steps anyway, and the rest are added between steps, while the GPU runs the step in
    flight, instead of all before the first one."""
    outs: list = [None] * len(requests)
    in_flight = 4 * engine.config.max_num_seqs
    with tqdm(total=len(requests), desc=desc, disable=disable) as bar:
        for i, out in engine.stream(requests, max_in_flight=in_flight):
            outs[i] = out
            bar.update(1)
    return outs
