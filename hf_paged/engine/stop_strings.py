"""Stop-string matching: HF ``stop_strings`` with transformers' own criterion (``StopStrings``,
a ``core.stop.StopMatcher``), and the engine's few recently built ones (``StopStringsCache``).

``StopStrings`` decides HF ``stop_strings`` matches, skipping the criterion for a newest token
that no stop string can end in (read from the criterion's own tables, so the answer is the same).
lm-eval's rule, which searches decoded text, lives with lm-eval (``integration/lm_eval/``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


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
        self._can_end = _final_token_table(criterion)

    @classmethod
    def build(cls, tokenizer, stop: Sequence[str]) -> StopStrings:
        from transformers.generation.stopping_criteria import StopStringCriteria

        return cls(StopStringCriteria(tokenizer, list(stop)))

    def matches(self, token_ids: list[int], end: int | None = None) -> bool:
        """A stop string ends at ``token_ids[end - 1]`` (default: the last token). Overlapped
        stepping passes ``end``: the tokens after it are still on the device."""
        end = len(token_ids) if end is None else end
        can_end = self._can_end
        if can_end is not None and not can_end[min(token_ids[end - 1], len(can_end) - 1)]:
            return False  # what the criterion itself finds first: no stop string ends here
        tail = token_ids[max(0, end - self.window) : end]
        tail = torch.tensor([tail], dtype=torch.long)  # [1, <= window]
        return bool(self.criterion(tail, None)[0])


def _final_token_table(criterion) -> list[bool] | None:
    """Per token id (the criterion's clamped range), whether it can be the final token of a
    match: the criterion's own first test (a positive "end length" for some stop string; a
    match needs one at the newest token). None (no shortcut) when its tables are not the ones
    this reads, or a stop string is empty (an empty string matches everywhere)."""
    vec = getattr(criterion, "embedding_vec", None)
    num, width = len(criterion.stop_strings), getattr(criterion, "max_valid_positions", None)
    if not isinstance(vec, torch.Tensor) or vec.dim() != 2 or not isinstance(width, int):
        return None
    if any(len(s) == 0 for s in criterion.stop_strings):
        return None
    end_lens = vec[:, width * num : -1]  # [V + 1, num * max_valid_end_lens]
    return (end_lens > 0).any(dim=1).tolist()


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
