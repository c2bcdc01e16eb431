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
    """True when ``get_model_class`` would return a class."""
    try:
        get_model_class(hf_config)
    except ValueError:
        return False
    return True


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
) -> nn.Module:
    """Build the native model with uninitialised ``dtype`` parameters allocated on ``device``.

    Global torch state (default dtype and device) is left as it was. Load weights next with
    ``hf_paged.models.loader.load_weights``.
    """
    cls = get_model_class(hf_config)
    with torch.device(device), default_dtype(dtype):
        model = cls(hf_config, ctx)
    return model.eval()
