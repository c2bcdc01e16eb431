"""What a request returns to its caller: ``RequestOutput`` (one per prompt) with its
``CompletionOutput`` s, and the ``PromptLogprob`` entries of ``SamplingParams.prompt_logprobs``.
Plain data: the runner fills ``PromptLogprob`` s, the engine builds the rest."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's score: its logprob given the tokens before it, and the top k.

    ``rank`` is 1 when the token is the argmax (ties broken like ``torch.argmax``: lowest id
    first), so ``rank == 1`` is lm-eval's ``is_greedy`` for that token.
    """

    token_id: int
    logprob: float  # log_softmax in fp32 of the model's logits
    rank: int  # 1 + how many ids come before it in (logprob desc, id asc) order
    top: dict[int, float]  # the k most likely ids -> logprob, most likely first

    def as_dict(self) -> dict[int, float]:
        """vLLM's shape: {token_id: logprob} with the actual token and the top k."""
        return {self.token_id: self.logprob, **self.top}


@dataclass
class CompletionOutput:
    """One completion of a request (a request with ``n`` > 1 has n of these)."""

    index: int
    token_ids: list[int]  # generated ids, including the stop token when it ended on one
    text: str | None  # detokenized ``token_ids`` (None without a tokenizer)
    finish_reason: str | None  # "stop" | "length" | "abort"
    logprobs: list[tuple[float, dict[int, float]]] | None = None  # per token, when asked

    @property
    def cumulative_logprob(self) -> float | None:
        """Sum of the generated tokens' logprobs (vLLM's); None without ``logprobs``."""
        return None if self.logprobs is None else sum(lp for lp, _top in self.logprobs)


@dataclass
class RequestOutput:
    """What ``LLM.generate`` returns per prompt, in input order."""

    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # with SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (and
    # for those before ``prompt_logprobs_start``); None when not asked
    prompt_logprobs: list[PromptLogprob | None] | None = None
    finished: bool = True  # vLLM's field: a returned request has finished (stop, length, abort)

    # the first completion's fields, for the common n == 1 case
    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str | None:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self):
        return self.outputs[0].logprobs
