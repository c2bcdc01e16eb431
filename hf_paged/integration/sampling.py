"""HF generation semantics -> engine ``SamplingParams``, and whether the engine can do it natively.

The mapping reads the ``LogitsProcessorList`` and ``StoppingCriteriaList`` that HF's own
``_get_logits_processor`` / ``_get_stopping_criteria`` built for the call, not the
``GenerationConfig`` fields: HF decides which processors a config implies (``top_k=50`` by default
when sampling, ``temperature=1`` adds nothing, ``min_new_tokens`` needs an EOS id ...), so reading
its result keeps the semantics HF's by construction. Any processor or criterion outside the small
set below sends the call down the external-sampling path, where HF's objects run as they are.

No engine and no model here: plain objects in, ``SamplingParams`` (or the reason it can't be) out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
)

from hf_paged.config import SamplingParams
from hf_paged.engine.stop import StopStrings

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class NativePlan:
    """What one call needs from the engine's own sampler (one ``SamplingParams`` per row)."""

    temperature: float  # 0 = greedy
    top_k: int  # -1 = off
    top_p: float
    min_p: float
    repetition_penalty: float
    max_tokens: int  # new tokens per row (every row of a generate call gets the same budget)
    min_tokens: int  # call's EOS ids masked until this many new tokens
    # the call's EOS ids; ignore_eos=True so the engine's own EOS ids neither stop nor get masked
    stop_token_ids: tuple[int, ...]
    # the call's StopStringCriteria as an engine matcher (None: no stop strings)
    stop_strings: StopStrings | None = field(default=None, compare=False)
    # assisted decoding: the proposer's plan (``integration/assisted.py``), None = none
    spec: object | None = field(default=None, compare=False)

    def sampling_params(self, seed: int | None = None) -> SamplingParams:
        """The engine request for one row; ``seed`` only matters when sampling."""
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            max_tokens=self.max_tokens,
            min_tokens=min(self.min_tokens, self.max_tokens),
            stop_token_ids=self.stop_token_ids,
            stop=self.stop_strings.stop if self.stop_strings is not None else (),
            ignore_eos=True,
            seed=seed if self.temperature > 0 else None,
        )


class NotNative(Exception):
    """The call needs HF's processors/criteria run outside the engine; ``str(e)`` says why."""


def _ids(t) -> tuple[int, ...]:
    if t is None:
        return ()
    if isinstance(t, torch.Tensor):
        return tuple(int(i) for i in t.reshape(-1).tolist())
    if isinstance(t, int):
        return (t,)
    return tuple(int(i) for i in t)


def plan_native(
    processors: Sequence,
    criteria: Sequence,
    *,
    do_sample: bool,
    input_length: int,
    vocab_size: int,
    left_padded: bool,
) -> NativePlan:
    """The engine-native equivalent of HF's prepared processors and criteria.

    Args:
        processors: the call's ``LogitsProcessorList`` as HF built it (user processors included).
        criteria: the call's ``StoppingCriteriaList`` as HF built it (user criteria included).
        do_sample: ``generation_config.do_sample``.
        input_length: ``L``, the padded prompt width (HF's lengths count from it).
        vocab_size: logits width (``top_k >= vocab`` means off).
        left_padded: every row's attended tokens are one contiguous run ending at column L-1
            (HF's repetition penalty skips only leading pads; the engine sees only the prompt).

    Returns:
        A ``NativePlan``.

    Raises:
        NotNative: something only HF's objects can do (the message names it).
    """
    temperature, top_k, top_p, min_p, penalty = 1.0, -1, 1.0, 0.0, 1.0
    min_tokens, min_eos = 0, None
    for p in processors:
        kind = type(p)
        if kind is TemperatureLogitsWarper:
            temperature = float(p.temperature)
        elif kind is TopKLogitsWarper:
            _check_warper(p)
            top_k = -1 if p.top_k >= vocab_size else int(p.top_k)
        elif kind is TopPLogitsWarper:
            _check_warper(p)
            top_p = float(p.top_p)
        elif kind is MinPLogitsWarper:
            _check_warper(p)
            min_p = float(p.min_p)
        elif kind is RepetitionPenaltyLogitsProcessor:
            if not isinstance(p.prompt_ignore_length, (torch.Tensor, type(None))):
                raise NotNative("repetition_penalty with an integer prompt_ignore_length")
            if not left_padded:
                raise NotNative("repetition_penalty on rows that are not left padded")
            penalty = float(p.penalty)
        elif kind is MinLengthLogitsProcessor:
            min_tokens = max(min_tokens, int(p.min_length) - input_length)
            min_eos = _ids(p.eos_token_id)
        elif kind is MinNewTokensLengthLogitsProcessor:
            start = int(p.prompt_length_to_skip)
            min_tokens = max(min_tokens, start + int(p.min_new_tokens) - input_length)
            min_eos = _ids(p.eos_token_id)
        else:
            raise NotNative(f"logits processor {kind.__name__}")

    max_length, stop_ids, stop_strings = None, (), None
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            max_length = int(c.max_length)
        elif type(c) is EosTokenCriteria:
            stop_ids = _ids(c.eos_token_id)
        elif type(c) is StopStringCriteria and stop_strings is None:
            stop_strings = StopStrings(c)
        else:
            raise NotNative(f"stopping criterion {type(c).__name__}")
    if max_length is None:
        raise NotNative("no max_length")
    if stop_strings is not None and min_tokens > 0:
        raise NotNative("stop strings with a min length (HF matches them before it)")
    if min_tokens > 0 and min_eos is not None and set(min_eos) != set(stop_ids):
        raise NotNative("min length masking ids other than the stop ids")
    return NativePlan(
        temperature=temperature if do_sample else 0.0,
        top_k=top_k if do_sample else -1,
        top_p=top_p if do_sample else 1.0,
        min_p=min_p if do_sample else 0.0,
        repetition_penalty=penalty,
        # stock's loop always runs once, so a prompt at max_length still gets one token
        max_tokens=max(1, max_length - input_length),
        min_tokens=max(0, min_tokens),
        stop_token_ids=stop_ids,
        stop_strings=stop_strings,
    )


def _check_warper(p) -> None:
    if getattr(p, "min_tokens_to_keep", 1) != 1:
        raise NotNative(f"{type(p).__name__} with min_tokens_to_keep={p.min_tokens_to_keep}")
    if getattr(p, "filter_value", _NEG_INF) != _NEG_INF:
        raise NotNative(f"{type(p).__name__} with filter_value={p.filter_value}")


def native_plan(call, vocab_size: int) -> NativePlan | None:
    """``plan_native`` for a prepared generate call; None when it must sample externally."""
    try:
        plan = plan_native(
            call.processors,
            call.criteria,
            do_sample=bool(call.generation_config.do_sample),
            input_length=call.input_ids.shape[1],
            vocab_size=vocab_size,
            left_padded=call.left_padded,
        )
    except NotNative:
        return None
    if plan.stop_strings is not None and not _stop_strings_native(call, plan):
        return None
    return plan


def _stop_strings_native(call, plan: NativePlan) -> bool:
    """Whether the engine's stop-string matching sees what stock's does for every row.

    Stock matches on the padded row: its window (the last ``window`` tokens) must hold no pad,
    so a padded row's prompt plus its first new token must fill the window. A row that stops
    keeps getting tokens in stock unless the call has an EOS criterion (then pads, as here)
    or the row is alone (then the loop ends)."""
    if not plan.stop_token_ids and len(call.prompts) > 1:
        return False
    if not call.left_padded:
        return False
    width, window = call.input_ids.shape[1], plan.stop_strings.window
    return all(len(p) == width or len(p) + 1 >= window for p in call.prompts)
