"""A text-generation pipeline over many inputs as ONE engine run (continuous batching).

Stock ``pipe(list_or_dataset_or_generator, batch_size=B)`` preprocesses every input, pads them in
batches of B, calls ``model.generate`` once per batch and postprocesses. ``PagedTextGenerationPipeline``
keeps all of that but the model stage: each batch is prepared as that ``generate`` call would be
(the very keyword arguments the pipeline's own ``_forward`` passes, stock's preparation of them),
its rows go into one ``engine.stream`` shared by the whole call, and when all rows of a batch
are back its outputs are rebuilt as stock's ``generate`` returns them, so the pipeline's own
unbatching and ``postprocess`` run unchanged. Requests in flight are bounded by the stream's
window (``4 * max_num_seqs``); outputs come back in input order; a dataset or generator input
gives a lazy iterator, as stock's does.

A batch the engine cannot sample itself (a streamer, scores, user processors or criteria, an
empty prompt, ``backend="hf"``, whatever the paged ``generate`` would send to stock) ends the
current engine run once its requests are done, and runs through the pipeline's own forward:
the per-batch path, paged where that ``generate`` is. An error while preparing a row (a bad
input, bad generation options) is raised after the outputs of the rows before it, as stock's
loop would; the engine's requests are aborted and drained first.
"""

from __future__ import annotations

import collections.abc
import contextlib
import itertools
from dataclasses import dataclass, field

from torch.utils.data import DataLoader
from transformers.pipelines.base import no_collate_fn, pad_collate_fn
from transformers.pipelines.pt_utils import PipelineDataset, PipelineIterator
from transformers.pipelines.text_generation import TextGenerationPipeline

from hf_paged.config import EngineConfig
from hf_paged.integration import dispatch
from hf_paged.integration import generate as _generate

# keywords the dispatcher consumes (or stock alone reads) before preparing a paged call
_SWITCHES = ("backend", "paged_config")
_STOCK_ONLY = (
    "assistant_model", "custom_generate", "synced_gpus", "negative_prompt_ids",
    "negative_prompt_attention_mask", "trust_remote_code",
)  # fmt: skip


class StreamingTextGenerationMixin:
    """Overrides ``get_iterator`` (what ``Pipeline.__call__`` uses for a list, a dataset or a
    generator) so that all batches share one engine run. A single input still takes
    ``run_single``: one paged ``generate`` call."""

    def get_iterator(
        self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params
    ):
        if not _streams(self.model):
            return super().get_iterator(
                inputs, num_workers, batch_size, preprocess_params, forward_params,
                postprocess_params,
            )  # fmt: skip
        # stock's own input side: preprocess per item, pad per batch (DataLoader, same workers)
        if isinstance(inputs, collections.abc.Sized):
            dataset = PipelineDataset(inputs, self.preprocess, preprocess_params)
        else:
            dataset = PipelineIterator(inputs, self.preprocess, preprocess_params)
            num_workers = min(num_workers, 1)
        extractor = self.feature_extractor or self.image_processor
        collate = no_collate_fn if batch_size == 1 else pad_collate_fn(self.tokenizer, extractor)
        loader = DataLoader(dataset, num_workers=num_workers, batch_size=batch_size,
                            collate_fn=collate)  # fmt: skip
        batches = BatchStream(self, loader, forward_params)
        # stock's own output side: unbatch, then postprocess each item
        model_iterator = PipelineIterator(batches, _identity, {}, loader_batch_size=batch_size)
        return PipelineIterator(model_iterator, self.postprocess, postprocess_params)


class PagedTextGenerationPipeline(StreamingTextGenerationMixin, TextGenerationPipeline):
    """``TextGenerationPipeline`` whose many-input calls stream through the paged engine."""


def streaming_class(cls: type) -> type:
    """``cls`` (a ``TextGenerationPipeline`` subclass) with the streaming ``get_iterator``."""
    if cls is TextGenerationPipeline:
        return PagedTextGenerationPipeline
    if issubclass(cls, StreamingTextGenerationMixin):
        return cls
    return type(f"Paged{cls.__name__}", (StreamingTextGenerationMixin, cls), {})


def _identity(x):
    return x


def _streams(model) -> bool:
    from hf_paged.integration.auto import PagedModelForCausalLM

    return isinstance(model, PagedModelForCausalLM) or dispatch.is_installed()


# ---- per-batch model outputs ------------------------------------------------------------------


@dataclass
class _Item:
    """One collated batch from the loader, with the ``generate`` keywords stock would pass."""

    inputs: dict | None = None  # None: the loader is exhausted
    kwargs: dict | None = None
    error: Exception | None = None  # raised when this item's turn comes
    stock: bool = False  # known to need the pipeline's own forward


@dataclass
class _Job:
    """A batch whose rows are in the engine."""

    item: _Item
    call: object  # PreparedCall
    requests: list
    tokens: list = field(default_factory=list)  # per row: new token ids, None until done
    num_open: int = 0


class _Captured(Exception):
    """Raised by ``_CaptureModel.generate``: carries the keywords it was called with."""

    def __init__(self, kwargs: dict):
        super().__init__("generate call captured")
        self.kwargs = kwargs


class _CaptureModel:
    """Stands in for the pipeline's model in one ``_forward`` call: records ``generate``'s
    keywords (whatever this transformers version's ``_forward`` derives from the options)."""

    def __init__(self, model):
        self._model = model

    def __getattr__(self, name):
        return getattr(self._model, name)

    def generate(self, *args, **kwargs):
        if args:
            raise TypeError("a pipeline's generate call is expected to pass keywords only")
        raise _Captured(kwargs)


def _capturing_view(pipe):
    """A shallow copy of the pipeline (same class, same attributes) whose ``model`` is a
    ``_CaptureModel``: ``_forward`` runs on it as on the pipeline; other threads' calls on the
    pipeline itself are untouched."""
    view = object.__new__(type(pipe))
    view.__dict__.update(pipe.__dict__)
    view.model = _CaptureModel(pipe.model)
    return view


class BatchStream:
    """Iterates per-batch model outputs (what stock's ``forward`` returns), in order."""

    def __init__(self, pipe, loader, forward_params: dict):
        self._pipe = pipe
        self._loader = loader
        self._forward_params = forward_params
        self._it = None
        self._next: _Item | None = None  # pulled, not yet handled
        self._plans: dict = {}  # _plan_key -> (NativePlan, rows per input, pad id)

    def __len__(self) -> int:
        return len(self._loader)  # TypeError for an iterable input, as stock's

    def __iter__(self):
        self._it = iter(self._loader)
        return self._run()

    def _run(self):
        while True:
            item = self._take()
            if item.error is not None:
                raise item.error
            if item.inputs is None:
                return
            route = None if item.stock else _route(self._pipe.model, item.kwargs)
            with contextlib.ExitStack() as held:
                try:
                    engine = None if route is None else held.enter_context(route.hold())
                except _generate.PagedFallback:  # this thread holds the engine already
                    engine = None
                job = None if engine is None else self._prepare(item, engine, route)
                if job is not None:
                    yield from self._segment(engine, route, job)
                    continue
            yield self._pipe.forward(item.inputs, **self._forward_params)

    def _take(self) -> _Item:
        if self._next is not None:
            item, self._next = self._next, None
            return item
        try:
            inputs = next(self._it)
        except StopIteration:
            return _Item()
        except Exception as e:  # a bad row: raised in order, after the rows before it
            return _Item(error=e)
        try:
            return _Item(inputs, self._capture(inputs))
        except Exception as e:
            return _Item(error=e)

    def _capture(self, inputs: dict) -> dict:
        """The keywords ``_forward`` would call ``model.generate`` with for this batch (run on a
        view of the pipeline whose model records them, so other threads' calls are untouched)."""
        pipe = self._pipe
        model_inputs = pipe._ensure_tensor_on_device(dict(inputs), device=pipe.device)
        try:
            _capturing_view(pipe)._forward(model_inputs, **self._forward_params)
        except _Captured as c:
            return c.kwargs
        raise RuntimeError("the pipeline's _forward did not call model.generate")

    def _prepare(self, item: _Item, engine, route) -> _Job | None:
        """The batch's engine requests, or None (marks the item) when it needs the pipeline's
        own forward. Raises what stock's preparation of the call raises."""
        kwargs = {k: v for k, v in item.kwargs.items() if k not in _SWITCHES + _STOCK_ONLY}
        ids = kwargs.get("input_ids")  # [in_b, W]
        key = None if ids is None else _plan_key(kwargs, route.prep_model)
        try:
            if key in self._plans:  # stock prepared this call for another prompt already
                plan, rows_per_input, pad = self._plans[key]
                call = _Rows(ids.repeat_interleave(rows_per_input, dim=0), pad)
                if max(map(len, call.prompts)) + plan.max_tokens > engine.runtime.max_model_len:
                    plan = None  # what check_fits reports: stock's forward runs it
            elif ids is None or route.precheck(item.kwargs) is not None:
                plan = None
            else:
                call = _generate.prepare_call(route.prep_model, **kwargs)
                plan = _generate.plan_call(call, engine)
                if key is not None and plan is not None:
                    self._plans[key] = (plan, len(call.prompts) // ids.shape[0], call.pad_token_id)
        except _generate.PagedFallback:
            plan = None
        if plan is None:
            item.stock = True
            return None
        requests = _generate.native_requests(call, plan)
        return _Job(item, call, requests, [None] * len(requests), len(requests))

    def _segment(self, engine, route, first: _Job):
        """One engine run over consecutive batches that the engine samples itself; yields each
        batch's model outputs as soon as it and every batch before it are done."""
        pending: collections.deque[_Job] = collections.deque()
        slots: dict[int, tuple[_Job, int]] = {}  # stream index -> (job, row)
        counter = itertools.count()

        def requests():
            job = first
            while True:
                pending.append(job)
                for row, req in enumerate(job.requests):
                    slots[next(counter)] = (job, row)
                    yield req
                item = self._take()
                if (
                    item.inputs is None
                    or item.error is not None
                    or route.key != _route_key(self._pipe.model, item.kwargs)
                ):
                    self._next = item  # handled after this run's requests are done
                    return
                try:
                    job = self._prepare(item, engine, route)
                except Exception as e:
                    job, self._next = None, _Item(error=e)
                if job is None:
                    self._next = self._next or item
                    return

        with engine.stream(requests()) as stream:
            for index, out in stream:
                job, row = slots.pop(index)
                job.tokens[row] = out.outputs[0].token_ids
                job.num_open -= 1
                while pending and pending[0].num_open == 0:
                    yield model_outputs(pending.popleft())


def model_outputs(job: _Job) -> dict:
    """What stock's ``forward`` returns for the batch: sequences ``[in_b, n, W + T]`` on the CPU,
    the padded ``input_ids`` ``[in_b, W]`` and the prompt text(s)."""
    seqs = _generate.native_sequences(job.call, job.tokens).cpu()  # [in_b * n, W + T]
    input_ids = job.item.inputs["input_ids"]
    in_b = input_ids.shape[0]
    return {
        "generated_sequence": seqs.reshape(in_b, seqs.shape[0] // in_b, *seqs.shape[1:]),
        "input_ids": input_ids,
        "prompt_text": job.item.inputs["prompt_text"],
    }


# ---- one preparation for many prompts ------------------------------------------------------------

_SIMPLE = (int, float, str, bool, type(None))


@dataclass
class _Rows:
    """The part of a PreparedCall that building requests and sequences reads."""

    input_ids: object  # [B * n, W], rows repeated for num_return_sequences
    pad_token_id: int | None

    @property
    def prompts(self) -> list[list[int]]:
        return self.input_ids.tolist()


def _plan_key(kwargs: dict, model) -> tuple | None:
    """A key under which batches get the same NativePlan from stock's preparation, or None.

    Only unpadded batches whose lengths are relative (``max_new_tokens``, no absolute
    ``max_length`` / ``min_length``) and whose options are plain values: then stock's processors
    and criteria depend on the prompt only through its length L, and every length they hold is
    L plus a constant (max_length = L + max_new_tokens, min new tokens), which the plan stores
    as the constant. Stop strings see no pads in such rows, whatever L is.
    """
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        return None
    gen = model.generation_config
    if kwargs.get("max_new_tokens") is None or kwargs.get("max_length") is not None:
        return None
    if kwargs.get("min_length") or getattr(gen, "min_length", 0):
        return None
    items = []
    for k, v in sorted(kwargs.items()):
        if k in ("input_ids", "attention_mask"):
            continue
        if isinstance(v, _SIMPLE) or (
            isinstance(v, (list, tuple)) and all(isinstance(x, _SIMPLE) for x in v)
        ):
            items.append((k, repr(v)))
        elif k == "tokenizer":  # the same object for the whole call (stop strings)
            items.append((k, id(v)))
        else:  # a GenerationConfig, processors, criteria, a streamer: prepare every batch
            return None
    return (kwargs["input_ids"].shape[0], tuple(items))


# ---- which engine a batch runs on ---------------------------------------------------------------


@dataclass(frozen=True)
class _Route:
    key: tuple  # batches with the same key share one engine run
    prep_model: object  # what stock's preparation runs on
    hold: object  # () -> context manager yielding the engine
    precheck: object  # generate kwargs -> (reason, detail) or None


def _route_key(model, kwargs: dict) -> tuple | None:
    from hf_paged.integration.auto import PagedModelForCausalLM

    backend, paged_config = kwargs.get("backend"), kwargs.get("paged_config")
    if isinstance(model, PagedModelForCausalLM):
        # other switches: the per-batch path raises the model's own error for them
        return ("paged_model",) if backend in (None, "paged") and paged_config is None else None
    if backend is None:
        backend = dispatch.get_default_backend()
    if backend != "paged" or not dispatch.is_installed():
        return None
    if isinstance(paged_config, dict):
        paged_config = EngineConfig.from_dict(paged_config)
    return ("hf", paged_config)


def _route(model, kwargs: dict) -> _Route | None:
    """How a batch with these ``generate`` keywords reaches the engine; None: it doesn't."""
    from hf_paged.integration.auto import PagedModelForCausalLM

    key = _route_key(model, kwargs)
    if key is None:
        return None
    if isinstance(model, PagedModelForCausalLM):

        def precheck(kw):  # the skeleton is on the meta device by design
            reason = dispatch.precheck(model.skeleton, kw, kw)
            return None if reason is None or reason[0] == "device" else reason

        return _Route(key, model.skeleton, model.hold_engine, precheck)
    return _Route(
        key, model, lambda: dispatch.hold_engine(model, key[1]),
        lambda kw: dispatch.precheck(model, kw, kw),
    )  # fmt: skip
