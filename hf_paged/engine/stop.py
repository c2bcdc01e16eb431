"""When a sequence stops: one pure rule for every stepping path, plus stop-string matching.

``check_stop`` is the whole stop rule on plain numbers; the synchronous step applies it to each
sampled token, and overlapped stepping applies it in two halves (length at launch, token values
when they reach the host). ``StopStrings`` decides HF ``stop_strings`` matches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hf_paged.config import SamplingParams


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


class StopStrings:
    """HF ``stop_strings`` matching for one set of stop strings and one tokenizer.

    It runs transformers' own ``StopStringCriteria`` on the tail of the token ids (that
    criterion reads only its last ``window`` tokens), so a match is exactly what stock
    ``generate`` decides: a stop string that overlaps the newest token, possibly reaching back
    into the prompt.
    """

    def __init__(self, criterion):
        self.criterion = criterion  # transformers StopStringCriteria
        self.stop: tuple[str, ...] = tuple(criterion.stop_strings)
        self.window: int = int(criterion.maximum_token_len)

    @classmethod
    def build(cls, tokenizer, stop: Sequence[str]) -> StopStrings:
        from transformers.generation.stopping_criteria import StopStringCriteria

        return cls(StopStringCriteria(tokenizer, list(stop)))

    def matches(self, token_ids: list[int], end: int | None = None) -> bool:
        """A stop string ends at ``token_ids[end - 1]`` (default: the last token). Overlapped
        stepping passes ``end``: the tokens after it are still on the device."""
        end = len(token_ids) if end is None else end
        tail = token_ids[max(0, end - self.window) : end]
        tail = torch.tensor([tail], dtype=torch.long)  # [1, <= window]
        return bool(self.criterion(tail, None)[0])


class StopStringsCache:
    """A few recently used ``StopStrings`` per (tokenizer, stop strings): building one reads
    the whole vocabulary."""

    def __init__(self, size: int = 8):
        self.size = size
        self._items: dict = {}  # (id(tokenizer), stop) -> (tokenizer, StopStrings)

    def get(
        self, stop: tuple[str, ...], given: StopStrings | None, tokenizer
    ) -> StopStrings | None:
        """The matcher for ``stop``: ``given`` (checked against ``stop``), else one built with
        ``tokenizer``; None when ``stop`` is empty.

        Raises:
            ValueError: ``given`` matches other strings, or no tokenizer to build one.
        """
        if not stop:
            return None
        if given is not None:
            if given.stop != stop:
                raise ValueError(
                    f"stop_strings matches {given.stop!r} but stop={stop!r}: build it from the "
                    "same strings"
                )
            return given
        if tokenizer is None:
            raise ValueError(
                f"stop={stop!r} is not allowed without a tokenizer: save one beside the "
                "checkpoint or pass tokenizer=..."
            )
        key = (id(tokenizer), stop)
        if key not in self._items:
            if len(self._items) >= self.size:
                self._items.pop(next(iter(self._items)))
            self._items[key] = (tokenizer, StopStrings.build(tokenizer, stop))  # keeps id valid
        return self._items[key][1]
