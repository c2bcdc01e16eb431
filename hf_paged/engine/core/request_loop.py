"""The one way to drive requests through an engine: submit, step, collect, abort-and-drain.

``RequestGroup`` is the step-wise form (callers that act between steps, such as the external
sampling path of ``generate``); ``stream`` and ``run`` are built on it. Whatever ends a caller's
loop early (an exception, Ctrl-C, a generator closed by its consumer), every request of the group
still in flight is aborted and stepped until the engine has reported it, so its KV blocks are
free and the engine is usable afterwards.

The engine only needs ``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests``, a
``config.max_num_seqs`` and a ``requests`` table with ``join_group`` / ``leave_group``, so a
stand-in engine with that surface works too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sized

from hf_paged.engine.core.outputs import RequestOutput
from hf_paged.engine.core.request import EngineRequest, budget, check_request_type


class RequestGroup:
    """The requests one caller added to an engine, stepped until each has been reported.

    Use it as a context manager: leaving the block by an exception (any BaseException, also
    ``GeneratorExit``) aborts every request of the group still in flight and drains them.

    Several groups may be open on one engine at once (two streams iterated in turn, an
    ``LLM.generate`` inside a loop over ``engine.stream``): every step runs all of them, and a
    request finished by another group's step is recorded in its own group (the engine's request
    table keeps which group added each request: ``RequestTable.join_group``).

    Args:
        engine: the engine the group's requests run in.
        keep_outputs: keep every reported output (``outputs``, ``take_finished``); False for a
            long-lived group whose requests end aborted (a draft model's): nothing piles up.

    Attributes:
        rids: request ids in the order they were added (with ``keep_outputs``).
        outputs: request id -> RequestOutput, once the engine reported it (with
            ``keep_outputs``).
    """

    def __init__(self, engine, *, keep_outputs: bool = True):
        self.engine = engine
        self.keep_outputs = keep_outputs
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
        if self.keep_outputs:
            self.rids.append(rid)
        self._open.add(rid)
        self.engine.requests.join_group(rid, self)
        return rid

    def step(self):
        """One engine step; records each finished request in the group that added it (this one
        or another open on the engine). Returns the step result."""
        res = self.engine.step()
        for out in res.finished:
            group = self.engine.requests.leave_group(out.request_id)
            if group is not None:
                group._record(out)
        return res

    def _record(self, out: RequestOutput) -> None:
        if out.request_id in self._open:
            self._open.discard(out.request_id)
            if self.keep_outputs:
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
            ended = [rid for rid in rids if rid not in self._open]
            if ended:
                out = self.outputs.get(ended[0])
                reason = out.outputs[0].finish_reason if out is not None else None
                raise RuntimeError(
                    f"the engine ended request {ended[0]!r} itself (finish_reason={reason!r})"
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
            for rid in self._open:  # not drained: nobody is left to record them
                self.engine.requests.leave_group(rid)


_END = object()  # the end of ``stream``'s input


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
                check_request_type(req, f"requests[{num_added}]")  # None is not the end
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
