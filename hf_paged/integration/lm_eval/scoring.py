"""lm-eval requests as engine requests, and engine outputs as lm-eval results. Plain data in and
out: no lm_eval import, no engine.

Loglikelihood (HFLM ``_loglikelihood_tokens``): stock runs ``model(inp)`` on
``inp = (context + continuation)[-(max_length + 1):][:-1]`` and scores the last
``len(continuation)`` rows. The engine gets exactly ``inp`` as the prompt, with
``prompt_logprobs=0`` from the first continuation token and the last continuation token as
``prompt_logprobs_next`` (scored from the last position's logits), so no position beyond stock's
``max_length`` is ever fed; the result is the sum of those tokens' logprobs and whether each was
the argmax (``rank == 1``).

Prefix sharing: the continuations of one context share its KV through the prefix cache. The
scheduler holds a continuation back while another one of the same context is still prefilling
it (``Scheduler._held_back``), so the requests go in as lm-eval orders them.
"""

from __future__ import annotations

from hf_paged.config import SamplingParams
from hf_paged.engine.core.outputs import RequestOutput


def score_window(
    context_enc: list[int], continuation_enc: list[int], max_length: int
) -> tuple[list[int], int]:
    """(scored window, index of its first scored token) for one loglikelihood request; the
    engine's prompt is the window without its last token (``score_params``).

    Raises:
        ValueError: an empty context or continuation, or a continuation over ``max_length``
            tokens (stock asserts the same).
    """
    if not context_enc or not continuation_enc:
        raise ValueError(
            f"loglikelihood request with {len(context_enc)} context and "
            f"{len(continuation_enc)} continuation tokens is not allowed: both must be non-empty"
        )
    if len(continuation_enc) > max_length:
        raise ValueError(
            f"continuation of {len(continuation_enc)} tokens is not allowed: must be <= "
            f"max_length={max_length}"
        )
    window = (context_enc + continuation_enc)[-(max_length + 1) :]
    return window, len(window) - len(continuation_enc)


def score_params(window: list[int], start: int) -> SamplingParams:
    """For the prompt ``window[:-1]``: score ``window[start:]`` (the last token as
    ``prompt_logprobs_next``), then one greedy token (discarded)."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=1,
        ignore_eos=True,
        prompt_logprobs=0,
        prompt_logprobs_start=start,
        prompt_logprobs_next=window[-1],
    )


def loglikelihood_result(out: RequestOutput, start: int) -> tuple[float, bool]:
    """(sum of the scored tokens' logprobs, every scored token was the argmax)."""
    scored = out.prompt_logprobs[start:]
    if not scored or any(e is None for e in scored):
        raise RuntimeError(f"request {out.request_id!r} came back without its prompt logprobs")
    return float(sum(e.logprob for e in scored)), all(e.rank == 1 for e in scored)
