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
input, bad generation options) or out of the input itself (also a generator's KeyboardInterrupt)
is raised after the outputs of the rows before it, as stock's loop would; the engine's requests
are aborted and drained first.
"""

from __future__ import annotations

import collections.abc
import contextlib
import functools
import itertools
from dataclasses import dataclass, field

from torch.utils.data import DataLoader
from transformers.pipelines.base import no_collate_fn, pad_collate_fn
from transformers.pipelines.pt_utils import PipelineDataset, PipelineIterator
from transformers.pipelines.text_generation import TextGenerationPipeline

from hf_paged.integration.fallback import PagedFallback
from hf_paged.integration.pipeline.capture import KwargsCache
from hf_paged.integration.pipeline.engines import NOT_FORWARDED, engine_key, engine_target
from hf_paged.integration.plan import PlanCache
from hf_paged.integration.route import Native, route


class StreamingTextGenerationMixin:
    """Overrides ``get_iterator`` (what ``Pipeline.__call__`` uses for a list, a dataset or a
    generator) so that all batches share one engine run. A single input still takes
    ``run_single``: one paged ``generate`` call."""

    def get_iterator(
        self, inputs, num_workers, batch_size, preprocess_params, forward_params, postprocess_params
    ):
        return stream_iterator(self, super().get_iterator, inputs, num_workers, batch_size,
                               preprocess_params, forward_params, postprocess_params)  # fmt: skip


def generate_params(forward_params: dict) -> dict:
    """The ``generate`` keywords among a call's forward params: the params themselves for a
    text-generation pipeline, their ``generate_kwargs`` for an image-text-to-text one."""
    return forward_params.get("generate_kwargs") or forward_params


def may_page(pipe, forward_params: dict) -> bool:
    """Whether a call with these ``forward_params`` (the pipeline's ``generate`` keywords) can
    send batches to the engine: its ``backend`` is paged, or unset while the process default is
    paged, or the model is a ``PagedModelForCausalLM``."""
    from hf_paged.integration import dispatch
    from hf_paged.integration.auto import PagedModelForCausalLM

    if isinstance(pipe.model, PagedModelForCausalLM):
        return True
    forward_params = generate_params(forward_params)
    backend = forward_params.get("backend")
    if backend is None and forward_params.get("paged_config") is None:
        backend = dispatch.get_default_backend()
    return backend != "hf" and dispatch.is_installed()


def stream_iterator(pipe, stock_get_iterator, inputs, num_workers, batch_size,
                    preprocess_params, forward_params, postprocess_params):  # fmt: skip
    """``pipe``'s iterator over many inputs: stock's input and output sides around one engine
    run (``BatchStream``) when the call may go paged, else ``stock_get_iterator``'s."""
    if not may_page(pipe, forward_params):
        return stock_get_iterator(inputs, num_workers, batch_size, preprocess_params,
                                  forward_params, postprocess_params)  # fmt: skip
    # stock's own input side: preprocess per item, pad per batch (DataLoader, same workers)
    if isinstance(inputs, collections.abc.Sized):
        dataset = PipelineDataset(inputs, pipe.preprocess, preprocess_params)
    else:
        dataset = PipelineIterator(inputs, pipe.preprocess, preprocess_params)
        num_workers = min(num_workers, 1)
    extractor = pipe.feature_extractor or pipe.image_processor
    collate = no_collate_fn if batch_size == 1 else pad_collate_fn(pipe.tokenizer, extractor)
    loader = DataLoader(dataset, num_workers=num_workers, batch_size=batch_size,
                        collate_fn=collate)  # fmt: skip
    batches = BatchStream(pipe, loader, forward_params)
    # stock's own output side: unbatch, then postprocess each item
    model_iterator = PipelineIterator(batches, _identity, {}, loader_batch_size=batch_size)
    return PipelineIterator(model_iterator, pipe.postprocess, postprocess_params)


def patched_get_iterator(original):
    """``TextGenerationPipeline.get_iterator`` that streams when the call may go paged: a
    pipeline built by the stock ``pipeline`` function (a program that took it before
    ``import hf_paged``) with ``backend="paged"`` streams too."""

    @functools.wraps(original)
    def get_iterator(self, *args):
        return stream_iterator(self, functools.partial(original, self), *args)

    get_iterator.__hf_paged_original__ = original
    return get_iterator


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


# ---- per-batch model outputs ------------------------------------------------------------------


@dataclass
class _Item:
    """One collated batch from the loader, with the ``generate`` keywords stock would pass."""

    inputs: dict | None = None  # None: the loader is exhausted
    kwargs: dict | None = None
    error: BaseException | None = None  # raised when this item's turn comes
    stock: bool = False  # known to need the pipeline's own forward


@dataclass
class _Job:
    """A batch whose rows are in the engine."""

    item: _Item
    call: Native
    requests: list
    tokens: list = field(default_factory=list)  # per row: new token ids, None until done
    num_open: int = 0


class BatchStream:
    """Iterates per-batch model outputs (what stock's ``forward`` returns), in order."""

    def __init__(self, pipe, loader, forward_params: dict):
        self._pipe = pipe
        self._loader = loader
        self._forward_params = forward_params
        self._it = None
        self._next: _Item | None = None  # pulled, not yet handled
        self._plans = PlanCache()
        self._kwargs = KwargsCache(pipe, forward_params)

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
            target = None if item.stock else engine_target(self._pipe.model, item.kwargs)
            with contextlib.ExitStack() as held:
                try:
                    engine = None if target is None else held.enter_context(target.hold())
                except (PagedFallback, RuntimeError):  # this thread holds the engine already
                    engine = None
                job = None if engine is None else self._prepare(item, engine, target)
                if job is not None:
                    yield from self._segment(engine, target, job)
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
        # a bad row, or the input raising (also KeyboardInterrupt / SystemExit from a generator):
        # raised in order, after the rows before it, which stock's loop returned before it
        # pulled this one
        except BaseException as e:
            return _Item(error=e)
        try:
            return _Item(inputs, self._kwargs.get(inputs))
        except Exception as e:
            return _Item(error=e)

    def _prepare(self, item: _Item, engine, target) -> _Job | None:
        """The batch's engine requests, or None (marks the item) when it needs the pipeline's
        own forward. Raises what stock's preparation of the call raises."""
        kwargs = {k: v for k, v in item.kwargs.items() if k not in NOT_FORWARDED}
        native = None
        if kwargs.get("input_ids") is not None and target.generate_refusal(item.kwargs) is None:
            try:
                native = route(target.prep_model, kwargs, lambda: engine, cache=self._plans)
            except PagedFallback:
                native = None
        if not isinstance(native, Native):  # external sampling, beams: per batch
            item.stock = True
            return None
        return _Job(item, native, native.requests, [None] * len(native.requests),
                    len(native.requests))  # fmt: skip

    def _segment(self, engine, target, first: _Job):
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
                    or target.key != engine_key(self._pipe.model, item.kwargs)
                ):
                    self._next = item  # handled after this run's requests are done
                    return
                try:
                    job = self._prepare(item, engine, target)
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
    the padded ``input_ids`` ``[in_b, W]`` and the prompt text(s) (preprocessed as
    ``prompt_text`` by a text-generation pipeline, ``text`` by an image-text-to-text one)."""
    seqs = job.call.sequences(job.tokens).cpu()  # [in_b * n, W + T]
    input_ids = job.item.inputs["input_ids"]
    in_b = input_ids.shape[0]
    return {
        "generated_sequence": seqs.reshape(in_b, seqs.shape[0] // in_b, *seqs.shape[1:]),
        "input_ids": input_ids,
        "prompt_text": job.item.inputs.get("prompt_text", job.item.inputs.get("text")),
    }
