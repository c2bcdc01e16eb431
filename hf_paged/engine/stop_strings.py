"""Stop-string matching: HF ``stop_strings`` with transformers' own criterion (``StopStrings``,
a ``core.stop.StopMatcher``), and a shortcut for matchers that search decoded text
(``StopTextFilter``).

``StopStrings`` decides HF ``stop_strings`` matches, skipping the criterion for a newest token
that no stop string can end in (read from the criterion's own tables, so the answer is the same);
``StopTextFilter`` is the same shortcut for matchers that search decoded text.
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


class StopTextFilter:
    """Which newest tokens can complete a stop string in a decoded text, for matchers that look
    for stop strings in ``tokenizer.decode`` of the last tokens (lm-eval's rule): a token whose
    text cannot hold the end of any stop string is skipped without decoding anything.

    Why it is safe: if a stop string is in the decoded window now and was not one token earlier,
    its occurrence ends inside the newest token's text, so that text ends with a piece of the
    stop string at the place where the stop string ends (``_ends_in``). That holds when decoding
    is concatenative up to deletions, which is what character, byte-level, metaspace and
    WordPiece decoders do. A token's text is taken both alone and after a plain letter, so the
    space a metaspace or WordPiece decoder puts before a word inside a text is seen. Where it
    cannot be decided the token is always checked: an empty text, an incomplete UTF-8 piece
    (U+FFFD), and every token when a stop string holds U+FFFD. Matchers whose window drops
    tokens at its front also ask ``front_ok`` for the token that becomes the window's first
    (WordPiece shows ``##`` there). ``tests/integration/test_stop_filter.py`` fuzzes it against
    the unfiltered check on those four kinds of tokenizer, stop strings ending in spaces and
    newlines included.
    """

    def __init__(self, tokenizer, stop: Sequence[str]):
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.always = not self.stop or any("\ufffd" in s for s in self.stop)
        self._info: dict[int, tuple[bool, bool]] = {}  # token id -> (may_end, front_ok)
        anchor = tokenizer.encode("a", add_special_tokens=False)
        self._anchor = anchor[-1:] if anchor else None
        self._anchor_text = tokenizer.decode(self._anchor) if anchor else ""

    def may_end(self, token_id: int) -> bool:
        """Whether a stop string can newly end in ``token_id``'s text (True when unsure)."""
        if self.always:
            return True
        info = self._info.get(token_id)
        return (info or self._learn(token_id))[0]

    def front_ok(self, token_id: int) -> bool:
        """Whether ``token_id`` decodes, at the start of a text, to an end of what it decodes
        to after other tokens (so a window starting at it shows no text that was not there)."""
        info = self._info.get(token_id)
        return (info or self._learn(token_id))[1]

    def fill(self) -> StopTextFilter:
        """Learn every token of the vocabulary now (two decodes each), so that matching never
        decodes a token's pieces mid-run; returns self."""
        if not self.always:
            for token_id in range(len(self.tokenizer)):
                if token_id not in self._info:
                    self._learn(token_id)
        return self

    def _learn(self, token_id: int) -> tuple[bool, bool]:
        pieces = self._pieces(token_id)
        if pieces is None:
            info = (True, False)
        else:
            may_end = any(_ends_in(s, p) for s in self.stop for p in pieces)
            info = (may_end, pieces[1].endswith(pieces[0]))
        self._info[token_id] = info
        return info

    def _pieces(self, token_id: int) -> tuple[str, str] | None:
        """(text alone, text after a plain letter), or None when either is undecidable."""
        alone = self.tokenizer.decode([token_id])
        if self._anchor is None:
            return None
        joined = self.tokenizer.decode(self._anchor + [token_id])
        if not joined.startswith(self._anchor_text):
            return None
        after = joined[len(self._anchor_text) :]
        if not alone or not after or "\ufffd" in alone or "\ufffd" in after:
            return None
        return alone, after


def _ends_in(stop: str, text: str) -> bool:
    """Whether an occurrence of ``stop`` in ``prefix + text`` can end inside ``text``, for some
    prefix: at some position q of ``text``, ``text[: q + 1]`` ends with the last q + 1 characters
    of ``stop`` (all of it when ``stop`` is shorter)."""
    last = stop[-1]
    q = text.find(last)
    while q >= 0:
        n = min(q + 1, len(stop))
        if text[q + 1 - n : q + 1] == stop[-n:]:
            return True
        q = text.find(last, q + 1)
    return False


_FILTERS: dict = {}  # (id(tokenizer), stop) -> (tokenizer, StopTextFilter), most recent last
_FILTERS_KEPT = 8


def text_filter(tokenizer, stop: Sequence[str]) -> StopTextFilter:
    """A filled ``StopTextFilter`` for ``stop``, shared by the calls that use the same tokenizer
    and stop strings (a few are kept): its vocabulary pass is paid once, not per call."""
    key = (id(tokenizer), tuple(stop))
    hit = _FILTERS.pop(key, None)
    if hit is None or hit[0] is not tokenizer:
        hit = (tokenizer, StopTextFilter(tokenizer, stop).fill())
    _FILTERS[key] = hit
    while len(_FILTERS) > _FILTERS_KEPT:
        _FILTERS.pop(next(iter(_FILTERS)))
    return hit[1]


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
