"""Which native model class serves an HF config, and how to build one cheaply."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from hf_paged.models.context import ModelContext
from hf_paged.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)

# config.architectures[0] -> class
_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}
# config.model_type -> class, used only when the config names no architecture (a config built in
# code rather than read from a checkpoint)
_MODEL_TYPES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def get_model_class(hf_config) -> type[nn.Module]:
    """The class for ``hf_config.architectures[0]``, or for ``model_type`` if none is named.

    Raises:
        ValueError: the architecture (or model type) is not supported; lists the supported ones.
    """
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        if archs[0] in _ARCHITECTURES:
            return _ARCHITECTURES[archs[0]]
        what = f"architecture {archs[0]!r}"
    else:
        model_type = getattr(hf_config, "model_type", None)
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        what = f"model_type {model_type!r} (no architectures in config)"
    raise ValueError(
        f"{what} is not supported by hf_paged: supported architectures are "
        f"{', '.join(supported_architectures())}"
    )


def is_supported(hf_config) -> bool:
    """True when ``get_model_class`` would return a class (a native implementation exists)."""
    try:
        get_model_class(hf_config)
    except ValueError:
        return False
    return True


MODEL_IMPLS = ("auto", "native", "generic")


def resolve_model_impl(hf_config, model_impl: str = "auto") -> str:
    """The path that serves ``hf_config``: "native" or "generic".

    "auto" is native where hf_paged has a class for the architecture, else generic.

    Raises:
        ValueError: an unknown ``model_impl``; "native" for an architecture without a native
            class; or a reason the generic path refuses the model (before building it).
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl={model_impl!r} is not allowed: must be one of {MODEL_IMPLS}")
    if model_impl == "native" or (model_impl == "auto" and is_supported(hf_config)):
        get_model_class(hf_config)  # raises for non-native architectures
        return "native"
    from hf_paged.models.generic.support import check_supported

    check_supported(hf_config)
    return "generic"


def unsupported_reason(hf_config, model_impl: str = "auto") -> str | None:
    """Why neither path (as ``model_impl`` selects) can serve ``hf_config``, or None. Cheap:
    builds nothing (the generic path's profile pass may still refuse a model later)."""
    try:
        resolve_model_impl(hf_config, model_impl)
    except ValueError as e:
        return str(e)
    return None


def model_class_reason(cls: type, hf_config, model_impl: str = "auto") -> str | None:
    """Why an in-memory model of class ``cls`` cannot be served, or None: the path serving its
    config must build exactly that class."""
    why = unsupported_reason(hf_config, model_impl)
    if why is not None:
        return why
    if resolve_model_impl(hf_config, model_impl) == "native":
        built = get_model_class(hf_config).__name__
    else:
        from hf_paged.models.generic.support import resolve_hf_class

        built = resolve_hf_class(hf_config).__name__
    if cls.__name__ != built:
        return f"{cls.__name__} is not the causal LM the engine builds for its config ({built})"
    return None


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Scope ``torch.set_default_dtype``; the previous default is restored on exit."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(
    hf_config,
    ctx: ModelContext,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    model_impl: str = "auto",
) -> nn.Module:
    """Build the model ``model_impl`` selects (see ``resolve_model_impl``).

    Native: uninitialised ``dtype`` parameters allocated on ``device``; load weights next with
    ``hf_paged.models.loader.load_weights``. Generic: ``GenericForCausalLM`` (parameters on meta
    until its ``load_weights``). Global torch state (default dtype and device) is left as it was.
    """
    if resolve_model_impl(hf_config, model_impl) == "generic":
        from hf_paged.models.generic import GenericForCausalLM

        return GenericForCausalLM(hf_config, ctx, dtype, torch.device(device))
    cls = get_model_class(hf_config)
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config, ctx)
    return model.eval()
