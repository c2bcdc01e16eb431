"""lm-eval's per-string ``HFLM.tok_encode``, done for many strings at once.

A multiple-choice task asks stock for two ``tokenizer.encode`` calls per request (context +
continuation, then the context alone), one string at a time, the context again for each of its
choices. :func:`encode_many` returns the same lists, but encodes each distinct string once, with
the fast tokenizer's batch call, in chunks over a few threads: the Rust batch call releases the
GIL, so the threads run in parallel even when ``TOKENIZERS_PARALLELISM=false`` (lm-eval's CLI sets
it) keeps each call on one thread.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor

from hf_paged.timing import spans

# strings of each group that are also encoded by ``lm.tok_encode``; any difference, and the
# whole call is stock's per-string ``tok_encode``
NUM_CHECKED = 4
# below this many distinct strings of a group, one batch call on this thread
MIN_POOLED = 64
MAX_THREADS = 8
# chunks per thread: long and short strings even out over the threads
CHUNKS_PER_THREAD = 4


def encode_many(
    lm, strings: Iterable[str], add_special_tokens: bool | None = None
) -> list[list[int]]:
    """``[lm.tok_encode(s, add_special_tokens=add_special_tokens) for s in strings]``, faster.

    Each distinct string is encoded once (a repeated string gets its own copy of the list). With
    lm-eval's own ``HFLM.tok_encode`` and a fast tokenizer, strings are grouped by the keywords
    ``tok_encode`` would pass to ``tokenizer.encode`` (``add_special_tokens`` from the argument or
    the HFLM's ``add_bos_token``; False for a string that starts with the prefix token's text)
    and each group is encoded by the tokenizer's batch call, with no padding or truncation. The
    first ``NUM_CHECKED`` strings of each group are also encoded by ``lm.tok_encode``: on any
    difference the whole call falls back to it, as it does for a slow tokenizer or an HFLM whose
    ``tok_encode`` is not lm-eval's.

    Args:
        lm: an lm-eval ``HFLM`` (or subclass).
        strings: the strings to encode.
        add_special_tokens: as ``HFLM.tok_encode``'s (None: the HFLM's default).

    Returns:
        One token-id list per string, in order.
    """
    strings = list(strings)
    distinct = list(dict.fromkeys(strings))
    with spans.span("client.tokenize"):  # what stock's tok_encode calls count under
        encoded = _encode_batched(lm, distinct, add_special_tokens) if _batchable(lm) else None
        if encoded is None:
            encoded = {s: lm.tok_encode(s, add_special_tokens=add_special_tokens) for s in distinct}
    out, seen = [], set()
    for s in strings:
        ids = encoded[s]
        out.append(ids if s not in seen else list(ids))  # no two results share a list
        seen.add(s)
    return out


def _batchable(lm) -> bool:
    """lm-eval's own ``HFLM.tok_encode`` over a fast tokenizer: what the batch path reproduces."""
    from lm_eval.models.huggingface import HFLM

    tok_encode = getattr(getattr(lm, "tok_encode", None), "__func__", None)
    fast = bool(getattr(lm.tokenizer, "is_fast", False))
    return fast and tok_encode is HFLM.__dict__["tok_encode"]


def _encode_batched(lm, distinct: list[str], add_special_tokens: bool | None):
    """``{string: ids}`` by the tokenizer's batch call, or None when the check against
    ``lm.tok_encode`` finds a difference."""
    groups = _group_by_kwargs(lm, distinct, add_special_tokens)
    encoded: dict[str, list[int]] = {}
    for key, group in groups.items():
        kwargs = {} if key is None else {"add_special_tokens": key}
        head, rest = group[:NUM_CHECKED], group[NUM_CHECKED:]
        # on this thread first: the check, and any one-time setup of the tokenizer's state
        # (truncation / padding off) happens before threads share it
        head_ids = _batch_call(lm.tokenizer, head, kwargs)
        if head_ids != [lm.tok_encode(s, add_special_tokens=add_special_tokens) for s in head]:
            return None
        encoded.update(zip(head, head_ids))
        encoded.update(zip(rest, _encode_pooled(lm.tokenizer, rest, kwargs)))
    return encoded


def _group_by_kwargs(lm, strings: list[str], add_special_tokens: bool | None) -> dict:
    """Strings by the ``add_special_tokens`` value ``HFLM.tok_encode`` gives ``tokenizer.encode``
    for each (None: not passed), its own rule: the argument, else ``add_bos_token``, and False
    for a string that starts with the decoded prefix token when the argument is None."""
    from lm_eval.models.utils import _add_special_kwargs, has_bos_prefix

    default = _add_special_kwargs(add_special_tokens, lm.add_bos_token).get("add_special_tokens")
    bos_text = None
    if add_special_tokens is None:
        bos_text = lm.tokenizer.decode(lm.prefix_token_id)  # tok_encode decodes it per string
    groups: dict[bool | None, list[str]] = {}
    for s in strings:
        key = False if bos_text is not None and has_bos_prefix(s, bos_text) else default
        groups.setdefault(key, []).append(s)
    return groups


def _batch_call(tokenizer, strings: Sequence[str], kwargs: dict) -> list[list[int]]:
    if not strings:
        return []
    return tokenizer(list(strings), **kwargs)["input_ids"]


def num_threads() -> int:
    """Threads for batch encoding: the CPUs this process may run on, at most ``MAX_THREADS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS))


def _encode_pooled(tokenizer, strings: list[str], kwargs: dict) -> list[list[int]]:
    """The batch call over chunks of ``strings`` on a thread pool (one call when short)."""
    threads = num_threads()
    if threads == 1 or len(strings) < MIN_POOLED:
        return _batch_call(tokenizer, strings, kwargs)
    size = -(-len(strings) // (threads * CHUNKS_PER_THREAD))
    chunks = [strings[i : i + size] for i in range(0, len(strings), size)]
    with ThreadPoolExecutor(threads, thread_name_prefix="hf-paged-tokenize") as pool:
        parts = pool.map(lambda chunk: _batch_call(tokenizer, chunk, kwargs), chunks)
        return [ids for part in parts for ids in part]
