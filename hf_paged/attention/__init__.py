"""Attention backends, registered lazily so optional dependencies load only when chosen."""

from __future__ import annotations

import importlib

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata

# name -> "module:Class"; imported on first use
_REGISTRY: dict[str, str] = {
    "torch": "hf_paged.attention.torch_ref:TorchRefBackend",
    "torch_batched": "hf_paged.attention.torch_batched:TorchBatchedBackend",
    "triton": "hf_paged.attention.triton_backend:TritonBackend",
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """Instantiate a backend by name. Raises ValueError for an unknown name."""
    if name not in _REGISTRY:
        raise ValueError(
            f"attention_backend={name!r} is not allowed: must be one of {available_backends()}"
        )
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def select_backend(device_type: str, requested: str | None = None) -> AttentionBackend:
    """The backend for a device: ``requested`` if given, else the fastest one that works there.

    CUDA gets the Triton backend when triton imports; everything else the batched torch
    backend (one attention call per layer per step; the torch reference is its oracle).

    Raises:
        ValueError: ``requested`` is unknown, or is "triton" on a device without a Triton
            driver (CPU, unless triton's interpreter is on: ``TRITON_INTERPRET=1``).
    """
    if requested is not None:
        if requested == "triton" and device_type != "cuda" and not _triton_interprets():
            raise ValueError(
                f"attention_backend='triton' is not allowed on device {device_type!r}: its "
                "kernels need CUDA; use attention_backend='torch' or None there"
            )
        return get_backend(requested)
    if device_type == "cuda":
        try:
            import triton  # noqa: F401

            return get_backend("triton")
        except ImportError:
            pass
    return get_backend("torch_batched")


def _triton_interprets() -> bool:
    """Whether triton runs kernels in its interpreter (any device), as it decides itself."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


__all__ = [
    "AttentionBackend",
    "AttentionLayerSpec",
    "AttentionMetadata",
    "available_backends",
    "get_backend",
    "select_backend",
]
