"""Which model path serves an HF config, and how to build it cheaply.

Two paths implement ``hf_paged.models.protocol.PagedModel``: the native decoders (registered
below by architecture) and the generic path over HF's own modules (``GENERIC``). Registries are
lazy, ``"Arch": ("module", "Class")`` like the attention registry: a model module is imported
only when chosen. ``model_impl`` picks the path: "native", "generic", or "auto" (native when the
architecture has a native class that does not refuse the config, else generic).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from hf_paged.layers.context import ModelContext
from hf_paged.models.protocol import PagedModel
from hf_paged.refusal import Refusal

MODEL_IMPLS = ("auto", "native", "generic")

_LLAMA = "hf_paged.models.llama"
# config.architectures[0] -> (module, class) of the native implementation
NATIVE_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": (_LLAMA, "LlamaForCausalLM"),
    "MistralForCausalLM": (_LLAMA, "MistralForCausalLM"),
    "Qwen2ForCausalLM": (_LLAMA, "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": (_LLAMA, "Qwen3ForCausalLM"),
}
# config.model_type -> architecture, used only when the config names no architecture (a config
# built in code rather than read from a checkpoint)
NATIVE_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# the generic path (any HF decoder through its own modules); its module may not exist yet
GENERIC: tuple[str, str] = ("hf_paged.models.generic", "GenericForCausalLM")


def supported_architectures() -> list[str]:
    """The architectures with a native implementation."""
    return sorted(NATIVE_ARCHITECTURES)


def _load(entry: tuple[str, str]) -> type:
    module, cls = entry
    return getattr(importlib.import_module(module), cls)


def _native_name(hf_config) -> tuple[str | None, str]:
    """(native architecture or None, how the config names its model for error messages)."""
    archs = getattr(hf_config, "architectures", None) or []
    if archs:
        native = archs[0] if archs[0] in NATIVE_ARCHITECTURES else None
        return native, f"architecture {archs[0]!r}"
    model_type = getattr(hf_config, "model_type", None)
    what = f"model_type {model_type!r} (no architectures in config)"
    return NATIVE_MODEL_TYPES.get(model_type), what


def get_model_class(hf_config) -> type:
    """The native class for ``hf_config.architectures[0]``, or for ``model_type`` if none is
    named.

    Raises:
        ValueError: no native implementation; lists the supported architectures.
    """
    arch, what = _native_name(hf_config)
    if arch is None:
        raise ValueError(
            f"{what} is not supported by hf_paged: supported architectures are "
            f"{', '.join(supported_architectures())}"
        )
    return _load(NATIVE_ARCHITECTURES[arch])


def _generic_class(why: str) -> type:
    try:
        return _load(GENERIC)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"model_impl='generic' is not available ({why}): {GENERIC[0]}.{GENERIC[1]} cannot "
            f"be imported ({exc}); use model_impl='native' with one of "
            f"{', '.join(supported_architectures())}"
        ) from exc


def resolve_model_class(hf_config, model_impl: str = "auto") -> type:
    """The class of the model path ``model_impl`` picks for ``hf_config``.

    Raises:
        ValueError: ``model_impl`` not one of ``MODEL_IMPLS``; "native" for an architecture
            without a native class; "generic" (or "auto" without a native class) while the
            generic path is not available. Each message names the reason. "auto" takes the
            generic path also where the native class's ``unsupported_refusal`` refuses the
            config (e.g. an FP8 layout its fused layers can't hold).
    """
    if model_impl not in MODEL_IMPLS:
        raise ValueError(
            f"model_impl={model_impl!r} is not allowed: model_impl must be one of "
            f"{list(MODEL_IMPLS)}"
        )
    if model_impl == "generic":
        return _generic_class("model_impl='generic' was asked for")
    arch, what = _native_name(hf_config)
    if model_impl == "native":
        return get_model_class(hf_config)
    if arch is None:
        why = f"{what} has no native implementation, so model_impl='auto' needs it"
        return _generic_class(why)
    native = get_model_class(hf_config)
    check = getattr(native, "unsupported_refusal", None)
    refusal = check(hf_config) if check is not None else None
    if refusal is None:
        return native
    try:  # e.g. an FP8 layout the fused native layers can't hold: HF's own modules can
        return _generic_class(f"the native {arch} refuses it: {refusal}")
    except ValueError:
        return native  # its refusal names why


def is_supported(hf_config, model_impl: str = "auto") -> bool:
    """True when ``resolve_model_class`` would return a class."""
    try:
        resolve_model_class(hf_config, model_impl)
    except ValueError:
        return False
    return True


def unsupported_refusal(hf_config, model_impl: str = "auto") -> Refusal | None:
    """Why the path ``model_impl`` picks cannot serve ``hf_config`` (reason "architecture"), or
    None. Cheap: builds nothing (the generic path's profile pass may still refuse a model when it
    is built)."""
    try:
        cls = resolve_model_class(hf_config, model_impl)
    except ValueError as e:
        return Refusal("architecture", str(e))
    check = getattr(cls, "unsupported_refusal", None)
    return check(hf_config) if check is not None else None


def model_class_refusal(model_cls: type, hf_config, model_impl: str = "auto") -> Refusal | None:
    """Why an in-memory model of class ``model_cls`` cannot be served, or None: the chosen path
    must serve its config and stand for exactly that class."""
    why = unsupported_refusal(hf_config, model_impl)
    if why is not None:
        return why
    cls = resolve_model_class(hf_config, model_impl)
    hf_class = getattr(cls, "hf_class", None)  # the generic path: the HF class it builds
    built = hf_class(hf_config).__name__ if hf_class is not None else cls.__name__
    if model_cls.__name__ != built:
        return Refusal(
            "architecture",
            f"{model_cls.__name__} is not the causal LM the engine builds for its config ({built})",
        )
    return None


def tp_split_refusal(hf_config, tp_size: int, model_impl: str = "auto") -> Refusal | None:
    """Why a model does not split over ``tp_size`` ranks (None: it does), judged before any
    worker starts. Query heads must divide evenly; KV heads divide evenly or, when fewer than
    the ranks, replicate (``tp_size`` a multiple of them); then the path ``model_impl`` picks
    says what else it needs (its ``tp_refusal``: the generic path's TP plan)."""
    if tp_size == 1:
        return None
    why = _head_split_refusal(hf_config, tp_size)
    if why is not None:
        return why
    check = getattr(resolve_model_class(hf_config, model_impl), "tp_refusal", None)
    return check(hf_config, tp_size) if check is not None else None


def _head_split_refusal(hf_config, tp_size: int) -> Refusal | None:
    cfg = getattr(hf_config, "text_config", None) or hf_config
    heads = getattr(cfg, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None  # the model path says what it needs when it is built
    kv = getattr(cfg, "num_key_value_heads", None) or heads

    def fits(t: int) -> bool:
        return heads % t == 0 and (kv % t == 0 if kv >= t else t % kv == 0)

    if fits(tp_size):
        return None
    sizes = [t for t in range(1, heads + 1) if fits(t)]
    return Refusal(
        "tensor_parallel_size",
        f"tensor_parallel_size={tp_size} is not allowed for this model: its "
        f"{heads} attention heads and {kv} KV heads do not split over {tp_size} ranks; "
        f"tensor_parallel_size must be one of {sizes}",
    )


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
) -> PagedModel:
    """Build the model path ``model_impl`` picks, with uninitialised ``dtype`` parameters on
    ``device``; load weights next with ``model.load_weights(source)``.

    A class is built as ``cls(hf_config, ctx)`` under ``torch.device(device)`` and the default
    dtype ``dtype``, unless it has a classmethod ``build(hf_config, ctx, dtype, device)`` (a
    path that builds on the meta device itself). Global torch state is left as it was.

    Raises:
        ValueError: see ``resolve_model_class``; and whatever the class raises for a config
            it cannot run.
        TypeError: the built object does not implement ``PagedModel`` (names what is missing).
    """
    cls = resolve_model_class(hf_config, model_impl)
    if hasattr(cls, "build"):
        model = cls.build(hf_config, ctx, dtype, torch.device(device))
    else:
        with torch.device(device), default_dtype(dtype):
            model = cls(hf_config, ctx)
    if not isinstance(model, PagedModel):
        missing = [
            n
            for n in ("kv_cache_specs", "supports_cuda_graph", "load_weights", "compute_logits")
            if not hasattr(model, n)
        ]
        raise TypeError(f"{cls.__name__} does not implement PagedModel: missing {missing}")
    return model.eval()
