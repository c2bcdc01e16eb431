"""lm-eval's stop rule on the engine: ``UntilMatcher`` (its ``MultiTokenEOSCriteria`` as a
``StopMatcher``) and ``StopTextFilter``, which lets it skip decoding for tokens that cannot
complete a stop string. ``until_matcher`` builds a row's matcher from one cache per
(tokenizer, stop strings): the filter's vocabulary pass and the stop strings' token lengths are
paid once, not per call.
"""

from __future__ import annotations

from collections.abc import Sequence


class UntilMatcher:
    """lm-eval's stop rule (``MultiTokenEOSCriteria``) as the engine's stop-string matcher.

    Stock marks a row done once a stop string ``s`` is in the decoding (special tokens kept) of
    its last ``len(encode(s)) + 2`` generated tokens; the prompt never counts. Here one decoding
    of the longest of those windows serves every stop string: it contains each shorter window's
    text, so a row stops no later than a stock batch of one would, and never before a stop
    string is in its generated text, after which stock's trimming gives the same text.

    Decoding is skipped when ``text_filter`` (shared by the rows of one set of stop strings)
    shows that the newest token cannot complete a stop string and the window's front shows no
    new text; a stop string then cannot have appeared since the previous token, whose check
    found none (every token is checked in order, and the first match ends the row).
    """

    def __init__(self, tokenizer, lookback: dict[str, int], prompt_len: int,
                 text_filter: StopTextFilter | None = None):  # fmt: skip
        self.tokenizer = tokenizer
        self.stop = tuple(lookback)  # == params.stop
        self.window = max(lookback.values())
        self.prompt_len = prompt_len
        self.text_filter = text_filter

    def matches(self, token_ids: list[int], end: int | None = None) -> bool:
        end = len(token_ids) if end is None else end  # tokens after ``end`` are in flight
        start = max(self.prompt_len, end - self.window)
        f = self.text_filter
        if (
            f is not None
            and not f.may_end(token_ids[end - 1])
            and (start == self.prompt_len or f.front_ok(token_ids[start]))
        ):
            return False
        text = self.tokenizer.decode(token_ids[start:end])
        return any(s in text for s in self.stop)


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
    (WordPiece shows ``##`` there). ``tests/integration/lm_eval/test_stop_text.py`` fuzzes it against
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


# (id(tokenizer), stop strings) -> (tokenizer, filled StopTextFilter, {stop: window}), most
# recent last; the tokenizer is kept so that its id stays valid
_CACHE: dict = {}
_CACHE_KEPT = 8


def until_matcher(tokenizer, stops: tuple[str, ...], prompt_len: int) -> UntilMatcher:
    """lm-eval's matcher for a row of ``prompt_len`` prompt tokens stopping at ``stops``
    (non-empty), with the filter and windows shared by every row of the same stop strings."""
    key = (id(tokenizer), tuple(stops))
    hit = _CACHE.pop(key, None)
    if hit is None or hit[0] is not tokenizer:
        lookback = {s: len(tokenizer.encode(s, add_special_tokens=False)) + 2 for s in stops}
        hit = (tokenizer, StopTextFilter(tokenizer, stops).fill(), lookback)
    _CACHE[key] = hit
    while len(_CACHE) > _CACHE_KEPT:
        _CACHE.pop(next(iter(_CACHE)))
    return UntilMatcher(tokenizer, hit[2], prompt_len, hit[1])
