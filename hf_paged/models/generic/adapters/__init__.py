"""Attention adapters: models whose attention modules compute attention by hand instead of
calling transformers' ``AttentionInterface`` (GPT-Neo, Bloom, Falcon, XGLM...).

An adapter is a replacement ``forward`` for one HF attention module class. It runs the
module's own projections and position encoding, calls ``paged_attention_forward`` (the function
the ``AttentionInterface`` models reach) with ``[1, H, T, D]`` query/key/value, then the
module's output projection, and returns what the original forward returns. Everything after
that is the generic path as for any other model: the profile pass records the call and checks
that flattened sequences stay independent, so an adapter that got the math wrong is refused at
build time (or caught by the coverage test), never served.

A family module (one file per model family, listed in ``_FAMILIES``) registers its adapters at
import with ``register``; ``install`` swaps them in on a built model. A family may also name a
``prepare`` per module class, called once on each such module of a built model (say, to switch
off a model-level computation its adapter does inside the attention instead).
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable

from torch import nn

# family modules under this package, imported on first use
_FAMILIES: tuple[str, ...] = (
    "big_bird",
    "bloom",
    "cpmant",
    "doge",
    "falcon",
    "gpt_neo",
    "gpt_neox_japanese",
    "llama4",
    "megatron_bert",
    "mpt",
    "openai_gpt",
    "rembert",
    "roformer",
    "trocr",
    "xglm",
    "xlm",
)

_ADAPTERS: dict[type, Callable] = {}  # HF attention module class -> replacement forward
_MODELS: set[str] = set()  # qualified names of the causal-LM classes the adapters serve
_PREPARE: dict[type, Callable] = {}  # HF module class -> called once on each built module


def register(model_classes: tuple[type, ...], adapters: dict[type, Callable],
             prepare: dict[type, Callable] | None = None) -> None:  # fmt: skip
    """Serve ``model_classes`` by replacing each ``adapters`` key's forward with its value,
    a function ``(module, *args, **kwargs)`` with the original forward's signature; ``prepare``
    maps module classes to a function called on each such module at ``install``."""
    _ADAPTERS.update(adapters)
    _PREPARE.update(prepare or {})
    _MODELS.update(_qualname(c) for c in model_classes)


@functools.cache
def _load() -> None:
    for family in _FAMILIES:
        importlib.import_module(f"{__name__}.{family}")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def serves(model_cls: type) -> bool:
    """Whether an adapter family serves the causal-LM class ``model_cls``."""
    _load()
    return _qualname(model_cls) in _MODELS


def install(model: nn.Module) -> int:
    """Replace the forward of every attention module of ``model`` that has an adapter; the
    number of modules adapted."""
    _load()
    n = 0
    for module in model.modules():
        setup = _PREPARE.get(type(module))
        if setup is not None:
            setup(module)
        fn = _ADAPTERS.get(type(module))
        if fn is not None:
            module.forward = types.MethodType(fn, module)
            n += 1
    return n
