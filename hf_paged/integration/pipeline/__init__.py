"""``pipeline("text-generation", model=..., backend="paged")``: HF pipelines on the paged engine.

``install_pipeline()`` replaces ``transformers.pipeline`` (and ``transformers.pipelines.pipeline``)
with a wrapper; ``uninstall_pipeline()`` puts the original function objects back. The wrapper
changes nothing unless the call passes ``backend`` or ``paged_config``:

* ``backend="paged"`` with ``model=<checkpoint directory>``: the model is opened with
  ``AutoPagedModelForCausalLM.from_pretrained`` (the HF model is never loaded) and the tokenizer is
  loaded from the same directory unless one is given. ``paged_config`` (a dict of EngineConfig
  keys) configures the engine; the pipeline's ``device`` / ``dtype`` become the engine's unless
  ``paged_config`` sets them.
* ``backend="paged"`` with a loaded model: the pipeline is built as usual and ``backend="paged"``
  (and ``paged_config``) go with every ``generate`` call it makes. This is transformers' own
  route: a text-generation pipeline hands its unknown keyword arguments to ``generate``, where
  the dispatcher (``hf_paged.install()``) pops them. A call may still override them
  (``pipe(text, backend="hf")``).
* ``backend="paged"`` with a PEFT adapter directory (``adapter_config.json``, no
  ``config.json``): transformers loads the base model and the adapter, and the calls go paged
  with the LoRA merged into the engine's weights (``models/peft.py``).
* ``backend="paged"`` with a quantized checkpoint directory whose ``quantization_config`` the
  engine does not serve (anything but its FP8 formats): the stock pipeline with stock calls, and
  a ``PagedFallbackWarning`` naming the method. FP8 checkpoints open paged like plain ones.
* ``backend="hf"``: stock, also when ``HF_PAGED_BACKEND=paged`` or
  ``set_default_backend("paged")`` would make the pipeline's calls paged.

Either way, and for a text-generation pipeline built while the process default is paged, the
pipeline is a ``PagedTextGenerationPipeline`` (``streaming.py``): called on a list, a
dataset or a generator it sends all inputs into one engine run, whatever ``batch_size`` is,
with stock's outputs in stock's order.

``pipeline("image-text-to-text", model=..., backend="paged")`` (a loaded model or a checkpoint
directory, which stock loads): every call's ``generate`` goes paged and many inputs stream
through one engine run (``image_text.py``); ``backend="hf"`` keeps it stock.

Only code that looks ``pipeline`` up after ``install_pipeline()`` (``transformers.pipeline(...)``,
or ``from transformers import pipeline`` executed later) sees the wrapper.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import torch
import transformers

_first_transformers = sys.modules["transformers"]
import transformers.pipelines  # noqa: E402, F401  (after the line above: see _modules)

from hf_paged.integration import dispatch, hooks  # noqa: E402
from hf_paged.integration.fallback import warn_fallback  # noqa: E402

TASK = "text-generation"
IMAGE_TASK = "image-text-to-text"
_lock = threading.Lock()


def _modules() -> list:
    """Every module object ``pipeline`` is looked up on. The first import of transformers'
    processing_utils re-executes ``transformers/__init__`` into a new module object and puts it in
    ``sys.modules`` (``direct_transformers_import``); code that imported transformers earlier
    holds the old one, which caches ``pipeline`` once read."""
    out = [sys.modules["transformers.pipelines"]]
    for m in (_first_transformers, sys.modules.get("transformers")):
        if m is not None and all(m is not o for o in out):
            out.append(m)
    return out


def install_pipeline() -> None:
    """Put the wrapper on ``transformers.pipeline`` and ``transformers.pipelines.pipeline``, and
    the streaming ``get_iterator`` on ``TextGenerationPipeline`` (for pipelines built by a
    ``pipeline`` function taken before this, with ``backend="paged"``). Idempotent."""
    from transformers.pipelines.text_generation import TextGenerationPipeline

    from hf_paged.integration.pipeline.streaming import patched_get_iterator

    with _lock:
        current = sys.modules["transformers.pipelines"].pipeline
        original = getattr(current, "__hf_paged_original__", current)
        wrapper = current if original is not current else _make_wrapper(original)
        for module in _modules():
            module.pipeline = wrapper
        get_iterator = TextGenerationPipeline.__dict__["get_iterator"] if (
            "get_iterator" in TextGenerationPipeline.__dict__) else None  # fmt: skip
        if getattr(get_iterator, "__hf_paged_original__", None) is None:
            TextGenerationPipeline.get_iterator = patched_get_iterator(
                TextGenerationPipeline.get_iterator
            )


def uninstall_pipeline() -> None:
    """Restore the original ``pipeline`` function objects and ``get_iterator``."""
    from transformers.pipelines.text_generation import TextGenerationPipeline

    with _lock:
        for module in _modules():
            current = getattr(module, "pipeline", None)
            original = getattr(current, "__hf_paged_original__", None)
            if original is not None:
                module.pipeline = original
        patched = TextGenerationPipeline.__dict__.get("get_iterator")
        original = getattr(patched, "__hf_paged_original__", None)
        if original is not None:
            if getattr(original, "__qualname__", "").startswith("TextGenerationPipeline."):
                TextGenerationPipeline.get_iterator = original
            else:  # it was inherited from Pipeline: remove the class's own attribute
                del TextGenerationPipeline.get_iterator


def is_pipeline_installed() -> bool:
    current = sys.modules["transformers.pipelines"].pipeline
    return getattr(current, "__hf_paged_original__", None) is not None


def _make_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def pipeline(*args, **kwargs):
        backend = kwargs.pop("backend", None)
        paged_config = kwargs.pop("paged_config", None)
        if backend is None and paged_config is None:
            return original(*args, **_default_paged(signature, args, kwargs))
        if backend not in (None, *dispatch.BACKENDS):
            raise ValueError(
                f"backend={backend!r} is not allowed: must be one of {list(dispatch.BACKENDS)}"
            )
        bound = signature.bind(*args, **kwargs)
        return _build(original, bound, backend, paged_config)

    pipeline.__hf_paged_original__ = original
    return pipeline


def _default_paged(signature, args, kwargs) -> dict:
    """``kwargs``, plus the streaming pipeline class for a text-generation pipeline built while
    the process default is paged (``HF_PAGED_BACKEND=paged``, ``hf-paged run``): its calls go
    paged anyway, and a list is then one engine run instead of one per batch."""
    if not dispatch.is_installed() or dispatch.get_default_backend() != "paged":
        return kwargs
    try:
        a = signature.bind(*args, **kwargs).arguments
    except TypeError:  # let the original raise its own error
        return kwargs
    if a.get("task") not in (TASK, IMAGE_TASK) or a.get("pipeline_class") is not None:
        return kwargs
    if a.get("task") == IMAGE_TASK:
        from hf_paged.integration.pipeline.image_text import image_streaming_class

        return {**kwargs, "pipeline_class": image_streaming_class(None)}
    return {**kwargs, "pipeline_class": _streaming_class(None)}


def _build(original, bound, backend, paged_config):
    from hf_paged.integration.auto import AutoPagedModelForCausalLM, PagedModelForCausalLM
    from hf_paged.models.peft import is_adapter_dir
    from hf_paged.models.servable import checkpoint_refusal as quantized_checkpoint_reason

    a = bound.arguments
    task, model = a.get("task"), a.get("model")
    if task not in (TASK, IMAGE_TASK):
        raise ValueError(
            f"task={task!r} is not allowed with backend={backend!r}: only task={TASK!r} and "
            f"task={IMAGE_TASK!r} generate through the paged engine"
        )
    if isinstance(paged_config, dict):
        paged_config = dict(paged_config)
    elif paged_config is not None and not _is_engine_config(paged_config):
        raise TypeError(
            f"paged_config={paged_config!r} is not allowed: must be a dict of EngineConfig keys "
            "or an EngineConfig"
        )
    extra = a.setdefault("kwargs", {})
    if task == IMAGE_TASK:
        return _build_image(original, bound, backend, paged_config)
    quantized = adapter_dir = None
    if backend == "paged" and isinstance(model, (str, os.PathLike)):
        quantized = quantized_checkpoint_reason(model)
        adapter_dir = is_adapter_dir(model)
    if quantized is not None:  # stock loads it with its quantizer; its calls stay stock
        warn_fallback(quantized, "pipeline(backend='paged')")
        extra["backend"] = "hf"
    elif adapter_dir:  # stock loads base + adapter; the calls go paged with LoRA merged
        extra.update({k: v for k, v in (("backend", backend), ("paged_config", paged_config)) if v})
    elif backend == "paged" and isinstance(model, (str, os.PathLike)):
        engine_kwargs = _engine_kwargs(paged_config, a.get("device"), a.get("dtype"))
        a["model"] = AutoPagedModelForCausalLM.from_pretrained(model, **engine_kwargs)
        if a.get("tokenizer") is None:
            a["tokenizer"] = os.fspath(model)
    elif model is None:
        raise ValueError(f"model=None is not allowed with backend={backend!r}: pass a model")
    elif isinstance(model, PagedModelForCausalLM):
        if backend == "hf" or paged_config is not None:
            raise ValueError(
                f"backend={backend!r}, paged_config={paged_config!r} are not allowed with a "
                "PagedModelForCausalLM: it always runs paged, on the engine from_pretrained built"
            )
    elif backend == "paged" or paged_config is not None:
        if not dispatch.is_installed():
            raise RuntimeError(
                f"backend={backend!r} needs the generate dispatcher: call hf_paged.install() "
                "first (import hf_paged does)"
            )
        # transformers hands a text-generation pipeline's unknown kwargs to every generate call
        extra.update({k: v for k, v in (("backend", backend), ("paged_config", paged_config)) if v})
    elif dispatch.is_installed():  # backend="hf": keep the pipeline stock whatever the default
        extra["backend"] = "hf"
    if backend != "hf":  # many-input calls stream through one engine run
        a["pipeline_class"] = _streaming_class(a.get("pipeline_class"))
    return original(*bound.args, **bound.kwargs)


def _build_image(original, bound, backend, paged_config):
    """An image-text-to-text pipeline: stock loads the model (a directory or a loaded one); the
    pipeline class takes ``backend`` / ``paged_config`` for every call's ``generate``."""
    from hf_paged.integration.pipeline.image_text import image_streaming_class

    a = bound.arguments
    if a.get("model") is None:
        raise ValueError(f"model=None is not allowed with backend={backend!r}: pass a model")
    if (backend == "paged" or paged_config is not None) and not dispatch.is_installed():
        raise RuntimeError(
            f"backend={backend!r} needs the generate dispatcher: call hf_paged.install() "
            "first (import hf_paged does)"
        )
    extra = a["kwargs"]
    if backend == "hf" and paged_config is not None:
        raise ValueError("paged_config=... is not allowed with backend='hf': stock runs the calls")
    extra.update({k: v for k, v in (("backend", backend), ("paged_config", paged_config)) if v})
    a["pipeline_class"] = image_streaming_class(a.get("pipeline_class"))
    return original(*bound.args, **bound.kwargs)


def _streaming_class(cls):
    from transformers.pipelines.text_generation import TextGenerationPipeline

    from hf_paged.integration.pipeline.streaming import streaming_class

    if cls is None:
        cls = TextGenerationPipeline
    return streaming_class(cls) if issubclass(cls, TextGenerationPipeline) else cls


def _is_engine_config(value) -> bool:
    from hf_paged.config import EngineConfig

    return isinstance(value, EngineConfig)


def _engine_kwargs(paged_config, device, dtype) -> dict:
    """Engine options for a path opened by the wrapper: ``paged_config`` first, then the
    pipeline's own ``device`` / ``dtype`` where it leaves them unset."""
    import dataclasses

    if paged_config is None:
        kwargs = {}
    elif isinstance(paged_config, dict):
        kwargs = dict(paged_config)
    else:
        kwargs = {f.name: getattr(paged_config, f.name) for f in dataclasses.fields(paged_config)}
    if device is not None and kwargs.get("device") is None:
        kwargs["device"] = _device_name(device)
    if dtype not in (None, "auto") and kwargs.get("dtype", "auto") == "auto":
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    return kwargs


def _device_name(device) -> str:
    """The pipeline's ``device`` (int, str or torch.device) as an engine device string."""
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu" if device < 0 else f"cuda:{device}"
    return str(torch.device(device))


hooks.module_ready(__name__)  # an install hooks deferred while this module executed
