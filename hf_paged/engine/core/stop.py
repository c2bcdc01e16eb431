"""When a sequence stops: one pure rule on plain numbers.

``check_stop`` is the whole stop rule; the engine applies it where a step's tokens are taken.
Stop strings are matched by a ``StopMatcher`` (``engine/stop_strings.py`` builds them with a
tokenizer) whose answer is one argument of the rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from hf_paged.config import SamplingParams


class StopMatcher(Protocol):
    """Decides whether one of a request's stop strings ends at a given token."""

    stop: tuple[str, ...]  # the stop strings it matches

    def matches(self, token_ids: list[int], end: int | None = None) -> bool:
        """A stop string ends at ``token_ids[end - 1]`` (default: the last token)."""
        ...


def check_stop(
    num_output_tokens: int,
    token_id: int | None,
    seq_len: int,
    params: SamplingParams,
    stop_ids: Sequence[int],
    max_model_len: int,
    stop_string_hit: bool = False,
) -> str | None:
    """The finish reason once the sequence holds ``seq_len`` tokens, or None to go on.

    Args:
        num_output_tokens: generated tokens so far, ``token_id`` included.
        token_id: the newest token; None when its value is not known yet (only the length
            limits are checked then).
        seq_len: prompt plus generated tokens.
        params: the request's SamplingParams (``min_tokens``, ``max_tokens``).
        stop_ids: ids that end the request (EOS unless ignored, plus ``stop_token_ids``).
        max_model_len: the engine's sequence limit.
        stop_string_hit: a stop string of the request ends at ``token_id``.

    Returns:
        "stop" (a stop id or stop string, once ``min_tokens`` are out), "length"
        (``max_tokens`` or ``max_model_len`` reached) or None.
    """
    if token_id is not None and num_output_tokens >= params.min_tokens:
        if stop_string_hit or token_id in stop_ids:
            return "stop"
    if num_output_tokens >= params.max_tokens or seq_len >= max_model_len:
        return "length"
    return None
