"""A request as the engine takes it (``EngineRequest``) and the checks ``add_request`` applies
before anything is queued: the prompt's ids, the combination of fields, ``max_tokens=None``
resolved against ``max_model_len``. Driving requests is ``request_loop.py``.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from hf_paged.config import SamplingParams
from hf_paged.engine.core.prompt_embeds import PromptEmbeds
from hf_paged.engine.core.proposer import Proposer, check_proposer
from hf_paged.engine.core.stop import StopMatcher


@dataclass
class EngineRequest:
    """One request, in the one shape it has from a front end to the scheduler: what
    ``LLMEngine.add_request`` takes (vLLM's ``EngineCoreRequest``).

    A new kind of input is a new field with a default that means "not used" (None or False), so
    that every caller built before it is unchanged; ``check_request`` checks how it combines
    with the others.
    """

    # the prompt's token ids: a list, tuple, or 1-D tensor / numpy array of ints
    prompt_token_ids: list[int]
    # how to sample and when to stop (None: ``SamplingParams()``'s defaults)
    params: SamplingParams | None = field(default_factory=SamplingParams)
    # the text the ids came from, echoed in the RequestOutput
    prompt: str | None = None
    # the id the engine reports it under; None: the engine numbers it
    request_id: int | str | None = None
    # matches ``params.stop`` (built with the caller's tokenizer); None: built from the engine's
    stop_strings: StopMatcher | None = None
    # proposes speculative tokens each step (``engine/spec/proposers.py``); None: one per step
    proposer: Proposer | None = None
    # the caller samples: ``step`` hands out its next-token logits and the sequence waits for
    # ``provide_token``; the engine never samples or stops it (but at ``max_model_len``)
    external_sampling: bool = False
    # (with ``external_sampling``) its sequences are beams the caller replaces at once with
    # ``provide_beams``; ``step`` hands out their logits per beam
    beam_search: bool = False
    # rows fed instead of embed(id) at some prompt positions (``generate(inputs_embeds=)``,
    # image features at their placeholder runs) and M-RoPE positions: a ``PromptEmbeds``
    # (``engine/core/prompt_embeds.py``); None: every prompt position from its id. Decode
    # always runs on ids.
    prompt_embeds: PromptEmbeds | None = None
    # sorted, disjoint prompt ranges (start, end) whose tokens attend to each other both ways
    # (Gemma 3's images; ``attention/bidirectional.py``): a prefill chunk never ends inside one.
    # None: causal everywhere
    bidirectional_ranges: list[tuple[int, int]] | None = None
    # the LoRA adapter it runs under: the key ``LLMEngine.add_lora`` returned (its name plus a
    # digest of its weights, ``models/adapters``); None: the base model
    lora_key: str | None = None


def validate_prompt(prompt_token_ids, vocab_size: int, max_model_len: int) -> list[int]:
    """The prompt as a list of ints (a list, tuple, 1-D tensor or 1-D numpy array of ids).

    Raises:
        TypeError: not a sequence of ids (``None``, an int, a string, bytes, a dict).
        ValueError: empty, an id that is not an int in ``[0, vocab_size)``, or no room for one
            new token under ``max_model_len``.
    """
    if _is_tensor(prompt_token_ids) or _is_array(prompt_token_ids):
        prompt_token_ids = prompt_token_ids.tolist()
    if isinstance(prompt_token_ids, (str, bytes, dict)) or not isinstance(
        prompt_token_ids, Iterable
    ):
        raise TypeError(
            f"prompt_token_ids={prompt_token_ids!r} is not allowed: must be a list, tuple or "
            "1-D tensor of token ids"
        )
    ids = list(prompt_token_ids)
    if not ids:
        raise ValueError("prompt_token_ids=[] is not allowed: a prompt needs at least 1 token")
    # fast path, in C: plain ints in range (bool is a subclass of int, not ``int`` itself)
    if not (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size):
        _check_each_id(ids, vocab_size)
    if len(ids) >= max_model_len:
        raise ValueError(
            f"prompt length {len(ids)} is not allowed: it must be < max_model_len={max_model_len} "
            "(room for at least one new token)"
        )
    return ids


def _is_tensor(x) -> bool:
    """A torch tensor, told without importing torch (a tensor exists only once it is loaded)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def _is_array(x) -> bool:
    """A numpy array, told without importing numpy."""
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(x, numpy.ndarray)


def check_request(request: EngineRequest, vocab_size: int) -> SamplingParams:
    """``add_request``'s checks on a request but its prompt; returns its params (None =
    defaults).

    Raises:
        TypeError: ``request`` is not an EngineRequest, its ``params`` not a SamplingParams,
            or its proposer has not the ``Proposer`` methods.
        ValueError: ``prompt_logprobs_next`` outside the vocabulary, ``n != 1`` or a proposer
            with external sampling, beam search without external sampling.
    """
    check_request_type(request, "request")
    params = SamplingParams() if request.params is None else request.params
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params={params!r} is not allowed: must be SamplingParams")
    nxt = params.prompt_logprobs_next
    if nxt is not None and nxt >= vocab_size:
        raise ValueError(f"prompt_logprobs_next={nxt} is not allowed: must be in [0, {vocab_size})")
    external, beam_search, proposer = (
        request.external_sampling,
        request.beam_search,
        request.proposer,
    )
    if external and params.n != 1:
        raise ValueError(f"n={params.n} is not allowed with external sampling: must be 1")
    if beam_search and not external:
        raise ValueError("beam_search=True is not allowed without external_sampling=True")
    if proposer is not None:
        check_proposer(proposer)
    if proposer is not None and beam_search:
        raise ValueError(
            "proposer=... is not allowed with beam_search=True: beams do not speculate"
        )
    if proposer is not None and external:
        raise ValueError(
            "proposer=... is not allowed with external_sampling=True: the caller samples each "
            "token itself"
        )
    return params


def check_request_type(request, name: str) -> None:
    """TypeError naming ``name`` unless ``request`` is an EngineRequest."""
    if not isinstance(request, EngineRequest):
        raise TypeError(f"{name}={request!r} is not allowed: must be an EngineRequest")


def _check_each_id(ids: list, vocab_size: int) -> None:
    """Convert ``ids`` to ints in place, raising on the first one that is not allowed."""
    for pos, t in enumerate(ids):
        try:  # ints, numpy ints and integer 0-d tensors; not bools, floats or strings
            ok = not isinstance(t, bool) and 0 <= operator.index(t) < vocab_size
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(
                f"prompt_token_ids[{pos}]={t!r} is not allowed: token ids must be ints in "
                f"[0, {vocab_size}) (the model's vocab_size)"
            )
        ids[pos] = operator.index(t)


def budget(params: SamplingParams | None) -> int:
    """Most tokens a request can generate (the unit of ``stream``'s progress callback); 0 for
    ``max_tokens=None`` (no bound known before the engine resolves it)."""
    params = SamplingParams() if params is None else params
    return (params.max_tokens or 0) * params.n


def resolve_max_tokens(params: SamplingParams, prompt_len: int, max_model_len: int):
    """``params`` with ``max_tokens=None`` made the room left under ``max_model_len`` (vLLM's
    meaning); other params as they are.

    Raises:
        ValueError: ``min_tokens`` is more than that room.
    """
    if params.max_tokens is not None:
        return params
    room = max_model_len - prompt_len
    if params.min_tokens > room:
        raise ValueError(
            f"min_tokens={params.min_tokens} is not allowed: the prompt of {prompt_len} tokens "
            f"leaves room for {room} under max_model_len={max_model_len}"
        )
    return dataclasses.replace(params, max_tokens=room)


def validate_bidirectional_ranges(ranges, prompt_len: int) -> list[tuple[int, int]]:
    """``ranges`` (``EngineRequest.bidirectional_ranges``) as a list of int pairs inside the
    prompt of ``prompt_len`` tokens.

    Raises:
        ValueError: not such pairs, or overlapping ones (named in the message).
    """
    from hf_paged.attention.bidirectional import check_ranges

    if not ranges:
        return []
    try:
        out = [(int(a), int(b)) for a, b in ranges]
    except (TypeError, ValueError):
        out = None
    if out is None or any(b > prompt_len for _, b in out):
        raise ValueError(
            f"bidirectional_ranges={ranges!r} is not allowed: must be (start, end) position "
            f"pairs inside the prompt of {prompt_len} tokens"
        )
    check_ranges(out)
    return out
