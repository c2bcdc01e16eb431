"""A prepared call's plan: HF generation semantics as engine ``SamplingParams`` (``NativePlan``),
with speculation as part of it (``SpecPlan``), whether the engine can sample it itself
(``native_plan``), whether its rows fit the engine (``fit_refusal``), and the plans of calls that
differ only in their prompt (``PlanCache``).

The mapping reads the ``LogitsProcessorList`` and ``StoppingCriteriaList`` that HF's own
``_get_logits_processor`` / ``_get_stopping_criteria`` built for the call, not the
``GenerationConfig`` fields: HF decides which processors a config implies (``top_k=50`` by default
when sampling, ``temperature=1`` adds nothing, ``min_new_tokens`` needs an EOS id ...), so reading
its result keeps the semantics HF's by construction. Any processor or criterion outside the small
set below sends the call down the external-sampling path, where HF's objects run as they are.

No engine and no model here: plain objects in (HF's processors and criteria, the engine's
``RuntimeInfo``), plans and ``Refusal`` out. ``route.py`` turns a plan into
engine requests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

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
from hf_paged.engine.stop_strings import StopStrings
from hf_paged.layers.rotary import length_dependent_limit
from hf_paged.refusal import Refusal

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class SpecPlan:
    """The proposer of an assisted call (``assisted.spec_plan``): the engine verifies several
    proposed tokens a step."""

    kind: str  # "ngram" (prompt lookup) or "draft" (assistant model)
    num_tokens: int  # prompt_lookup_num_tokens / num_assistant_tokens
    max_matching_ngram_size: int = 2  # ngram
    schedule: str = "constant"  # draft: num_assistant_tokens_schedule
    confidence_threshold: float | None = None  # draft: assistant_confidence_threshold


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
    # the call's StopStringCriteria (None: no stop strings); its engine matcher is
    # ``stop_strings``, built once when first asked for
    stop_criterion: StopStringCriteria | None = field(default=None, compare=False)
    # assisted decoding: the proposer's plan, None = none
    spec: SpecPlan | None = field(default=None, compare=False)

    @cached_property
    def stop_strings(self) -> StopStrings | None:
        """The engine's matcher for the call's stop strings (HF's own criterion inside)."""
        return None if self.stop_criterion is None else StopStrings(self.stop_criterion)

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
            stop=tuple(self.stop_criterion.stop_strings) if self.stop_criterion else (),
            ignore_eos=True,
            seed=seed if self.temperature > 0 else None,
        )

    @classmethod
    def from_processors(
        cls,
        processors: Sequence,
        criteria: Sequence,
        *,
        do_sample: bool,
        input_length: int,
        vocab_size: int,
        left_padded: bool,
    ) -> NativePlan | Refusal:
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
            The plan, or a ``Refusal`` when only HF's own objects can do it (the call then samples
            outside the engine).
        """
        temperature, top_k, top_p, min_p, penalty = 1.0, -1, 1.0, 0.0, 1.0
        min_tokens, min_eos = 0, None
        for p in processors:
            kind = type(p)
            if kind is TemperatureLogitsWarper:
                temperature = float(p.temperature)
            elif kind is TopKLogitsWarper:
                if refusal := _warper_refusal(p):
                    return refusal
                top_k = -1 if p.top_k >= vocab_size else int(p.top_k)
            elif kind is TopPLogitsWarper:
                if refusal := _warper_refusal(p):
                    return refusal
                top_p = float(p.top_p)
            elif kind is MinPLogitsWarper:
                if refusal := _warper_refusal(p):
                    return refusal
                min_p = float(p.min_p)
            elif kind is RepetitionPenaltyLogitsProcessor:
                if not isinstance(p.prompt_ignore_length, (torch.Tensor, type(None))):
                    return _refuse("repetition_penalty with an integer prompt_ignore_length")
                if not left_padded:
                    return _refuse("repetition_penalty on rows that are not left padded")
                penalty = float(p.penalty)
            elif kind is MinLengthLogitsProcessor:
                min_tokens = max(min_tokens, int(p.min_length) - input_length)
                min_eos = _ids(p.eos_token_id)
            elif kind is MinNewTokensLengthLogitsProcessor:
                start = int(p.prompt_length_to_skip)
                min_tokens = max(min_tokens, start + int(p.min_new_tokens) - input_length)
                min_eos = _ids(p.eos_token_id)
            else:
                return _refuse(f"logits processor {kind.__name__}")

        # stock stops a row when any criterion says so: the tightest length, every EOS id
        max_length, stop_ids, stop_criterion = None, (), None
        for c in criteria:
            if type(c) is MaxLengthCriteria:
                limit = math.ceil(c.max_length)  # stock stops at cur_len >= max_length
                max_length = limit if max_length is None else min(max_length, limit)
            elif type(c) is EosTokenCriteria:  # a negative id matches no token: no stop
                stop_ids += tuple(i for i in _ids(c.eos_token_id) if i >= 0 and i not in stop_ids)
            elif type(c) is StopStringCriteria and stop_criterion is None:
                stop_criterion = c
            else:
                return _refuse(f"stopping criterion {type(c).__name__}")
        if max_length is None:
            return _refuse("no max_length")
        if stop_criterion is not None and min_tokens > 0:
            return _refuse("stop strings with a min length (HF matches them before it)")
        if min_tokens > 0 and min_eos is not None and set(min_eos) != set(stop_ids):
            return _refuse("min length masking ids other than the stop ids")
        return cls(
            temperature=temperature if do_sample else 0.0,
            top_k=top_k if do_sample else -1,
            top_p=top_p if do_sample else 1.0,
            min_p=min_p if do_sample else 0.0,
            repetition_penalty=penalty,
            # stock's loop always runs once, so a prompt at max_length still gets one token
            max_tokens=max(1, max_length - input_length),
            min_tokens=max(0, min_tokens),
            stop_token_ids=stop_ids,
            stop_criterion=stop_criterion,
        )


def _ids(t) -> tuple[int, ...]:
    if t is None:
        return ()
    if isinstance(t, torch.Tensor):
        return tuple(int(i) for i in t.reshape(-1).tolist())
    if isinstance(t, int):
        return (t,)
    return tuple(int(i) for i in t)


def _refuse(detail: str) -> Refusal:
    """Why the engine's sampler can't run the call (it then samples outside the engine)."""
    return Refusal("external_sampling", detail)


def _warper_refusal(p) -> Refusal | None:
    if getattr(p, "min_tokens_to_keep", 1) != 1:
        return _refuse(f"{type(p).__name__} with min_tokens_to_keep={p.min_tokens_to_keep}")
    if getattr(p, "filter_value", _NEG_INF) != _NEG_INF:
        return _refuse(f"{type(p).__name__} with filter_value={p.filter_value}")
    return None


def native_plan(call, vocab_size: int) -> NativePlan | Refusal:
    """``NativePlan.from_processors`` for a prepared generate call, or a ``Refusal`` when it must
    sample externally (it observes steps: a streamer, scores, user processors or criteria; or HF
    objects the engine's sampler lacks; or it is a beam search, ``beam_search.py``)."""
    if call.beams:
        return _refuse("beam search runs its own loop")
    if call.observed:
        return _refuse("the caller observes every step (streamer, scores, processors, criteria)")
    plan = NativePlan.from_processors(
        call.processors,
        call.criteria,
        do_sample=bool(call.generation_config.do_sample),
        input_length=call.input_ids.shape[1],
        vocab_size=vocab_size,
        left_padded=call.left_padded,
    )
    if isinstance(plan, Refusal):
        return plan
    if plan.stop_criterion is not None and not _stop_strings_native(call, plan):
        return _refuse("stop strings the engine would match on other tokens than stock")
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
    width, window = call.input_ids.shape[1], int(plan.stop_criterion.maximum_token_len)
    return all(len(p) == width or len(p) + 1 >= window for p in call.prompts)


def fit_refusal(prompts: list[list[int]], max_new: int, runtime, *, held: str = "rows",
                num_beams: int = 1) -> Refusal | None:  # fmt: skip
    """The one "does it fit" check: a ``Refusal`` when the engine would cut a row short, or
    could not hold at once the KV that ``held`` says the call keeps; None when it fits.

    Args:
        prompts: the rows' attended tokens.
        max_new: new tokens per row at most.
        runtime: the engine's ``RuntimeInfo`` (``max_model_len``, ``num_kv_blocks``, block size).
        held: "rows" (native: the scheduler preempts and recomputes, so only the length counts),
            "batch" (external sampling: every row of a step is paused at once holding its KV),
            or "beams" (one row's ``num_beams`` beams at once, sharing the prompt: its longest
            beam plus, per other beam, a private tail of ``max_new`` and the copied partial
            block; less would recompute the row every step, beams beyond it are preempted).
    """
    if held not in ("rows", "batch", "beams"):
        raise ValueError(f"held={held!r} is not allowed: must be 'rows', 'batch' or 'beams'")
    prompt = max(len(p) for p in prompts)
    limit = runtime.max_model_len
    rope = length_dependent_limit(runtime.hf_config)
    if rope is not None and prompt + max_new > rope[1]:
        return Refusal(
            "rope_length",
            f"a row may reach {prompt + max_new} tokens, past the {rope[1]} after which the "
            f"model's rope_type {rope[0]!r} changes its frequencies with the batch's longest "
            "row, which the engine's batches and chunked prefills do not reproduce",
        )
    if prompt + max_new > limit:
        fix = (
            f"pass max_new_tokens <= {limit - prompt}"
            if prompt < limit
            else f"shorten the prompt below {limit} tokens"
        )
        return Refusal(
            "max_model_len",
            f"a row may reach {prompt + max_new} tokens (longest prompt {prompt} + "
            f"max_new_tokens={max_new}), over the engine's max_model_len={limit}: {fix}, "
            "or build the engine with a larger max_model_len",
        )
    block, have = runtime.config.kv_block_size, runtime.num_kv_blocks
    if held == "batch":
        need = sum(math.ceil((len(p) + max_new) / block) for p in prompts)
        what = "the batch needs"
    elif held == "beams":
        tail = (num_beams - 1) * (math.ceil(max_new / block) + 1)
        need = max(math.ceil((len(p) + max_new) / block) for p in prompts) + tail
        what = f"one row's {num_beams} beams need"
    else:
        return None
    if need > have:
        return Refusal("kv_cache", f"{what} up to {need} KV blocks at once, the engine has {have}")
    return None


_SIMPLE = (int, float, str, bool, type(None))


def _multimodal_keys(model) -> set[str]:
    """A vision-language model's image keywords (nothing for a text model)."""
    from hf_paged.integration import multimodal

    return multimodal.multimodal_keys(model) if multimodal.is_multimodal(model) else set()


class PlanCache:
    """Plans of calls that differ only in their prompt, keyed by everything else.

    Only unpadded calls with a length limit (``max_new_tokens``, or ``max_length``, keyed as
    ``max_length - L``) and no absolute ``min_length``, whose options are plain values, qualify:
    then stock's processors and criteria depend on the prompt only through its width L, and every
    length they hold is L plus a constant (max_length = L + max_new_tokens, min new tokens), which
    the plan stores as the constant. Stop strings see no pads in such rows, whatever L is.
    A vision-language model's image inputs (tensors) are keyed by name only: the plan does not
    depend on them, and the route turns each call's own into its rows' features.
    """

    def __init__(self):
        # key -> (plan, rows per input row, pad token id)
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
        mm_keys = _multimodal_keys(model) if any(
            isinstance(v, torch.Tensor) for v in kwargs.values()) else set()  # fmt: skip
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
            elif k in mm_keys and isinstance(v, torch.Tensor):  # the call's own images
                items.append((k, "tensor"))
            else:  # a GenerationConfig, processors, criteria, a streamer: prepare every call
                return None
        return (ids.shape[0], tuple(items))

    def get(self, key: tuple) -> tuple[NativePlan, int, int | None] | None:
        return self._plans.get(key)

    def put(self, key: tuple, value: tuple[NativePlan, int, int | None]) -> None:
        self._plans[key] = value
