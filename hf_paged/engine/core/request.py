"""The one way to drive requests through an engine: submit, step, collect, abort-and-drain.

``RequestGroup`` is the step-wise form (callers that act between steps, such as the external
sampling path of ``generate``); ``stream`` and ``run`` are built on it. Whatever ends a caller's
loop early (an exception, Ctrl-C, a generator closed by its consumer), every request of the group
still in flight is aborted and stepped until the engine has reported it, so its KV blocks are
free and the engine is usable afterwards.

The engine only needs ``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests`` and a
``config.max_num_seqs``, so a stand-in engine with that surface works too.
"""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from dataclasses import dataclass, field

from hf_paged.config import SamplingParams
from hf_paged.engine.core.outputs import RequestOutput
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


class RequestGroup:
    """The requests one caller added to an engine, stepped until each has been reported.

    Use it as a context manager: leaving the block by an exception (any BaseException, also
    ``GeneratorExit``) aborts every request of the group still in flight and drains them.

    Several groups may be open on one engine at once (two streams iterated in turn, an
    ``LLM.generate`` inside a loop over ``engine.stream``): every step runs all of them, and a
    request finished by another group's step is recorded in its own group (``_groups_of``).

    Attributes:
        rids: request ids in the order they were added.
        outputs: request id -> RequestOutput, once the engine reported it.
    """

    def __init__(self, engine):
        self.engine = engine
        self.rids: list = []
        self.outputs: dict = {}
        self._open: set = set()
        self._new: list[RequestOutput] = []  # reported since the last ``take_finished``

    @property
    def num_open(self) -> int:
        """Requests added and not yet reported finished."""
        return len(self._open)

    def add(self, request: EngineRequest):
        """Queue one request (``LLMEngine.add_request``); returns its id. Raises TypeError for
        anything but an ``EngineRequest``, and what ``add_request`` raises (nothing queued)."""
        check_request_type(request, "request")
        rid = self.engine.add_request(request)
        self.rids.append(rid)
        self._open.add(rid)
        _groups_of(self.engine)[rid] = self
        return rid

    def step(self):
        """One engine step; records each finished request in the group that added it (this one
        or another open on the engine). Returns the step result."""
        res = self.engine.step()
        groups = _groups_of(self.engine)
        for out in res.finished:
            group = groups.pop(out.request_id, None)
            if group is not None:
                group._record(out)
        return res

    def _record(self, out: RequestOutput) -> None:
        if out.request_id in self._open:
            self._open.discard(out.request_id)
            self.outputs[out.request_id] = out
            self._new.append(out)

    def await_logits(self, keys, budget: int) -> dict:
        """Step until every ``(request_id, beam)`` of ``keys`` has its next-token logits (an
        external-sampling request is beam 0); returns ``{key: logits row}``. A preempted request
        reports again: the same values.

        Raises:
            RuntimeError: the engine ended one of the requests itself, or ``budget`` steps did
                not bring every row.
        """
        want, got = set(keys), {}
        rids = {rid for rid, _ in want}
        for _ in range(budget):
            if want <= got.keys():
                return got
            res = self.step()
            got.update((key, row) for key, row in res.logits.items() if key in want)
            ended = [rid for rid in rids if rid in self.outputs]
            if ended:
                out = self.outputs[ended[0]]
                raise RuntimeError(
                    f"the engine ended request {ended[0]!r} itself "
                    f"(finish_reason={out.outputs[0].finish_reason!r})"
                )
        if want <= got.keys():
            return got
        raise RuntimeError(f"the engine made no progress on {len(want - got.keys())} row(s)")

    def take_finished(self) -> list[RequestOutput]:
        """This group's requests reported since the last call, in report order."""
        new, self._new = self._new, []
        return new

    def close(self, rid) -> None:
        """End ``rid`` now (paused or not); the engine reports it by a later step."""
        if rid in self._open:
            self.engine.abort(rid)

    def drain(self) -> None:
        """Step until every request of the group has been reported."""
        while self._open:
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(f"the engine lost {len(self._open)} request(s) of this caller")
            self.step()

    def abort_all(self) -> None:
        """Abort every open request and drain them (their blocks are free afterwards)."""
        for rid in list(self._open):
            self.engine.abort(rid)
        self.drain()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            return
        try:
            self.abort_all()
        except Exception:  # the original error matters more than a failed cleanup
            groups = _groups_of(self.engine)
            for rid in self._open:  # not drained: nobody is left to record them
                groups.pop(rid, None)


_END = object()  # the end of ``stream``'s input


def _groups_of(engine) -> dict:
    """Request id -> the open ``RequestGroup`` that added it, kept on the engine (any object with
    a ``__dict__``, so stand-in engines too); an id leaves when its finished output is recorded."""
    return engine.__dict__.setdefault("_hf_paged_request_groups", {})


def stream(
    engine,
    requests: Iterable[EngineRequest],
    *,
    max_in_flight: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> RequestStream:
    """Run requests, yielding ``(input index, RequestOutput)`` as each finishes.

    Args:
        engine: an LLMEngine (or the same surface).
        requests: pulled lazily; at most ``max_in_flight`` are in the engine at once.
        max_in_flight: None = no bound for a sized collection (list, tuple), and
            ``4 * max_num_seqs`` for an iterator or generator.
        progress: called with a number of tokens after every step (tokens generated) and when
            a request finishes (its unused budget), so the calls add up to the sum of
            ``max_tokens * n`` over the requests.

    Returns:
        A ``RequestStream`` (iterate it; use it in ``with`` when it is kept in a variable).

    Raises:
        ValueError: ``max_in_flight`` is not a positive int; or what ``add_request`` raises.
    """
    if max_in_flight is None and not isinstance(requests, Sized):
        max_in_flight = 4 * engine.config.max_num_seqs
    if max_in_flight is not None and (
        isinstance(max_in_flight, bool) or not isinstance(max_in_flight, int) or max_in_flight < 1
    ):
        raise ValueError(f"max_in_flight={max_in_flight!r} is not allowed: must be an int >= 1")
    return RequestStream(_stream(engine, iter(requests), max_in_flight, progress))


class RequestStream:
    """The iterator ``stream`` returns; also a context manager.

    Closing it (``close()``, leaving its ``with`` block, or garbage collection of an unfinished
    stream) aborts and drains the requests still in flight. A ``for`` loop over
    ``engine.stream(...)`` itself is closed as soon as an exception leaves the loop; keep a
    stream in a variable only inside ``with``.
    """

    def __init__(self, gen: Iterator[tuple[int, RequestOutput]]):
        self._gen = gen

    def __iter__(self):
        return self

    def __next__(self) -> tuple[int, RequestOutput]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stream(engine, it, max_in_flight, progress):
    index_of: dict = {}  # request id -> input index
    budget_of: dict = {}  # request id -> budget(params), for ``progress``
    num_added, exhausted = 0, False
    with RequestGroup(engine) as group:
        while True:
            while not exhausted and (max_in_flight is None or group.num_open < max_in_flight):
                req = next(it, _END)
                if req is _END:
                    exhausted = True
                    break
                check_request_type(req, f"requests[{num_added}]")  # a None once ended the input
                rid = group.add(req)
                index_of[rid], budget_of[rid] = num_added, budget(req.params)
                num_added += 1
            if group.num_open:  # else: only outputs another group's step recorded are left
                if not engine.has_unfinished_requests():
                    raise RuntimeError(
                        f"the engine lost {group.num_open} request(s) of this stream"
                    )
                res = group.step()
                if progress is not None:
                    progress(getattr(res, "num_generated_tokens", 0))
            finished = group.take_finished()
            if not finished and not group.num_open:
                return
            for out in finished:
                if progress is not None:
                    used = sum(len(c.token_ids) for c in out.outputs)
                    progress(max(0, budget_of.pop(out.request_id) - used))
                yield index_of.pop(out.request_id), out


def run(engine, requests: Iterable[EngineRequest], **kwargs) -> list[RequestOutput]:
    """Every request to completion; outputs in input order (``stream``'s keywords apply)."""
    done = dict(stream(engine, requests, **kwargs))
    return [done[i] for i in range(len(done))]
