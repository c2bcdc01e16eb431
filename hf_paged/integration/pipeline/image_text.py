"""``pipeline("image-text-to-text", model=..., backend="paged")``: the image pipeline on the engine.

Stock ``ImageTextToTextPipeline`` hands its unknown keyword arguments to the processor, not to
``generate``, so ``backend`` / ``paged_config`` are taken here, at construction or per call, and
put into the ``generate_kwargs`` of every call (a call's own ``generate_kwargs`` keep their
keys; a call's ``backend`` wins over the pipeline's). Called on a list, a dataset or a generator
of inputs (``{"images": ..., "text": ...}`` dicts or chats) it streams every batch into one
engine run, as the text-generation pipeline does (``streaming.py``): the vision tower runs stock
per batch, the decoder on the engine, and the outputs come back in stock's shape and order.
"""

from __future__ import annotations

from transformers.pipelines.image_text_to_text import ImageTextToTextPipeline

from hf_paged.integration.pipeline.streaming import StreamingTextGenerationMixin

TASK = "image-text-to-text"


class PagedImageTextToTextPipeline(StreamingTextGenerationMixin, ImageTextToTextPipeline):
    """``ImageTextToTextPipeline`` whose calls go paged and whose many-input calls stream
    through one engine run.

    Args:
        backend: "paged" (or "hf") for every call's ``generate``; None: the process default.
        paged_config: EngineConfig keys (a dict) or an ``EngineConfig`` for the engine.
    """

    def __init__(self, *args, backend: str | None = None, paged_config=None, **kwargs):
        self._paged_generate = {k: v for k, v in (("backend", backend),
                                                  ("paged_config", paged_config)) if v is not None}  # fmt: skip
        self._paged_built = False
        super().__init__(*args, **kwargs)
        self._paged_built = True

    def _sanitize_parameters(self, backend=None, paged_config=None, **kwargs):
        preprocess, forward, postprocess = super()._sanitize_parameters(**kwargs)
        call = {k: v for k, v in (("backend", backend), ("paged_config", paged_config))
                if v is not None}  # fmt: skip
        defaults = {**self._paged_generate, **call}
        # at construction the pipeline's own forward params take them; a call that sets its
        # own generate_kwargs (which replace the pipeline's, as stock's do) gets them too
        if defaults and (not self._paged_built or call or "generate_kwargs" in forward):
            forward["generate_kwargs"] = {**defaults, **forward.get("generate_kwargs", {})}
        return preprocess, forward, postprocess


def image_streaming_class(cls: type | None) -> type:
    """``cls`` (an ``ImageTextToTextPipeline`` subclass, None: the stock class) with the paged
    keywords and the streaming ``get_iterator``."""
    if cls is None or cls is ImageTextToTextPipeline:
        return PagedImageTextToTextPipeline
    if issubclass(cls, PagedImageTextToTextPipeline):
        return cls
    return type(f"Paged{cls.__name__}", (PagedImageTextToTextPipeline, cls), {})
