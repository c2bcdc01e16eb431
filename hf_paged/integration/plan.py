"""A prepared call's native plan: HF generation semantics as engine ``SamplingParams``, whether
the engine can sample it itself, whether it fits, and its engine requests.

The mapping reads the ``LogitsProcessorList`` and ``StoppingCriteriaList`` that HF's own
``_get_logits_processor`` / ``_get_stopping_criteria`` built for the call, not the
``GenerationConfig`` fields: HF decides which processors a config implies (``top_k=50`` by default
when sampling, ``temperature=1`` adds nothing, ``min_new_tokens`` needs an EOS id ...), so reading
its result keeps the semantics HF's by construction. Any processor or criterion outside the small
set below sends the call down the external-sampling path, where HF's objects run as they are.

No engine and no model here: plain objects in (HF's processors and criteria, the engine's
``RuntimeInfo``), plans, requests and ``PagedFallback`` out.
"""

from __future__ import annotations

import dataclasses
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
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.stop_strings import StopStrings
from hf_paged.integration.assisted import ngram_proposer
from hf_paged.integration.fallback import PagedFallback

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
    # the call's StopStringCriteria (None: no stop strings); its engine matcher is
    # ``stop_strings``, built once when first asked for
    stop_criterion: StopStringCriteria | None = field(default=None, compare=False)
    # assisted decoding: the proposer's plan (``assisted.SpecPlan``), None = none
    spec: object | None = field(default=None, compare=False)

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
        ``(NativePlan, None)``, or ``(None, why)`` when only HF's own objects can do it (the
        call then samples outside the engine).
    """
    temperature, top_k, top_p, min_p, penalty = 1.0, -1, 1.0, 0.0, 1.0
    min_tokens, min_eos = 0, None
    for p in processors:
        kind = type(p)
        if kind is TemperatureLogitsWarper:
            temperature = float(p.temperature)
        elif kind is TopKLogitsWarper:
            if why := _warper_reason(p):
                return None, why
            top_k = -1 if p.top_k >= vocab_size else int(p.top_k)
        elif kind is TopPLogitsWarper:
            if why := _warper_reason(p):
                return None, why
            top_p = float(p.top_p)
        elif kind is MinPLogitsWarper:
            if why := _warper_reason(p):
                return None, why
            min_p = float(p.min_p)
        elif kind is RepetitionPenaltyLogitsProcessor:
            if not isinstance(p.prompt_ignore_length, (torch.Tensor, type(None))):
                return None, "repetition_penalty with an integer prompt_ignore_length"
            if not left_padded:
                return None, "repetition_penalty on rows that are not left padded"
            penalty = float(p.penalty)
        elif kind is MinLengthLogitsProcessor:
            min_tokens = max(min_tokens, int(p.min_length) - input_length)
            min_eos = _ids(p.eos_token_id)
        elif kind is MinNewTokensLengthLogitsProcessor:
            start = int(p.prompt_length_to_skip)
            min_tokens = max(min_tokens, start + int(p.min_new_tokens) - input_length)
            min_eos = _ids(p.eos_token_id)
        else:
            return None, f"logits processor {kind.__name__}"

    max_length, stop_ids, stop_criterion = None, (), None
    for c in criteria:
        if type(c) is MaxLengthCriteria:
            max_length = int(c.max_length)
        elif type(c) is EosTokenCriteria:
            stop_ids = _ids(c.eos_token_id)
        elif type(c) is StopStringCriteria and stop_criterion is None:
            stop_criterion = c
        else:
            return None, f"stopping criterion {type(c).__name__}"
    if max_length is None:
        return None, "no max_length"
    if stop_criterion is not None and min_tokens > 0:
        return None, "stop strings with a min length (HF matches them before it)"
    if min_tokens > 0 and min_eos is not None and set(min_eos) != set(stop_ids):
        return None, "min length masking ids other than the stop ids"
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
        stop_criterion=stop_criterion,
    ), None


def _warper_reason(p) -> str | None:
    if getattr(p, "min_tokens_to_keep", 1) != 1:
        return f"{type(p).__name__} with min_tokens_to_keep={p.min_tokens_to_keep}"
    if getattr(p, "filter_value", _NEG_INF) != _NEG_INF:
        return f"{type(p).__name__} with filter_value={p.filter_value}"
    return None


def native_plan(call, vocab_size: int) -> NativePlan | None:
    """``plan_native`` for a prepared generate call; None when it must sample externally (it
    observes steps: a streamer, scores, user processors or criteria; or HF objects the engine's
    sampler lacks; or it is a beam search, ``beam_search.py``)."""
    if call.observed or call.beams:
        return None
    plan, _ = plan_native(
        call.processors,
        call.criteria,
        do_sample=bool(call.generation_config.do_sample),
        input_length=call.input_ids.shape[1],
        vocab_size=vocab_size,
        left_padded=call.left_padded,
    )
    if plan is None or (plan.stop_criterion is not None and not _stop_strings_native(call, plan)):
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
    width, window = call.input_ids.shape[1], int(plan.stop_criterion.maximum_token_len)
    return all(len(p) == width or len(p) + 1 >= window for p in call.prompts)


@dataclass
class NativeCall:
    """A call the engine samples itself: its rows, its plan and its engine requests."""

    input_ids: torch.Tensor  # [B, L] as given (rows repeated for num_return_sequences)
    prompts: list[list[int]]  # per row: the attended tokens
    pad_token_id: int | None
    plan: NativePlan
    requests: list[EngineRequest] = field(default_factory=list)

    def sequences(self, new: list[list[int]]) -> torch.Tensor:
        """Rows' new tokens -> stock's ``[B, L + T]`` (rows that stopped early padded)."""
        n, width = len(new), max(len(t) for t in new)
        pad = self.pad_token_id if self.pad_token_id is not None else 0  # unequal only with EOS
        ids = self.input_ids
        out = torch.full((n, ids.shape[1] + width), pad, dtype=ids.dtype, device=ids.device)
        out[:, : ids.shape[1]] = ids
        for i, toks in enumerate(new):
            out[i, ids.shape[1] : ids.shape[1] + len(toks)] = torch.tensor(toks, dtype=ids.dtype)
        return out


def plan_call(call, runtime, plan: NativePlan | None = None, spec=None) -> NativeCall | None:
    """The engine-native form of a prepared call (``prepare.PreparedCall``, or ``plan`` for rows
    whose preparation is known to give it), with its requests; None when it must sample
    externally. ``spec``: an assisted call's proposer plan (``assisted.spec_plan``); prompt
    lookup's proposer is attached to the requests here, a draft model's by the caller that holds
    the draft engine (``paged_call.generate_paged``).

    Seeds for sampled rows are drawn now from torch's global RNG, as stock's sampling would.

    Raises:
        PagedFallback: the engine would cut a row short, or (external) can't hold the batch, or
            an assisted call needs processors the engine does not implement.
    """
    if plan is None:
        plan = native_plan(call, runtime.vocab_size)
        if spec is not None:  # speculative steps serve native plans only
            if plan is None:
                raise PagedFallback(
                    "assisted_processors", "assisted decoding with logits processors or "
                    "stopping criteria the engine does not implement",
                )  # fmt: skip
            plan = dataclasses.replace(plan, spec=spec)
    check_fits(call.prompts, call.max_new_tokens if plan is None else plan.max_tokens, runtime,
               native=plan is not None)  # fmt: skip
    if plan is None:
        return None
    n = len(call.prompts)
    # from torch's global RNG, so torch.manual_seed reproduces a call, as it does stock's
    seeds = torch.randint(0, 2**62, (n,)).tolist() if plan.temperature > 0 else [None] * n
    params = [plan.sampling_params(s) for s in seeds]
    matcher = plan.stop_strings
    proposer = ngram_proposer(plan.spec) if plan.spec and plan.spec.kind == "ngram" else None
    requests = [
        EngineRequest(p, sp, stop_strings=matcher, proposer=proposer)
        for p, sp in zip(call.prompts, params, strict=True)
    ]
    return NativeCall(call.input_ids, call.prompts, call.pad_token_id, plan, requests)


def check_fits(prompts: list[list[int]], max_new: int, runtime, native: bool) -> None:
    """PagedFallback when the engine would cut a row short or (external path) could not hold
    the whole batch's KV at once (every row of a step is paused at once holding its KV)."""
    prompt = max(len(p) for p in prompts)
    limit = runtime.max_model_len
    if prompt + max_new > limit:
        fix = (
            f"pass max_new_tokens <= {limit - prompt}"
            if prompt < limit
            else f"shorten the prompt below {limit} tokens"
        )
        raise PagedFallback(
            "max_model_len",
            f"a row may reach {prompt + max_new} tokens (longest prompt {prompt} + "
            f"max_new_tokens={max_new}), over the engine's max_model_len={limit}: {fix}, "
            "or build the engine with a larger max_model_len",
        )
    if native:
        return
    block = runtime.config.kv_block_size
    need = sum(math.ceil((len(p) + max_new) / block) for p in prompts)
    if need > runtime.num_kv_blocks:
        raise PagedFallback(
            "kv_cache",
            f"the batch needs up to {need} KV blocks at once, the engine has "
            f"{runtime.num_kv_blocks}",
        )
