"""Reading one rank's part of a checkpoint tensor: where it lands (``ShardSlice``) and how it is
read from a full tensor or a lazy safetensors slice without reading the rest."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ShardSlice:
    """Where one checkpoint tensor (or one shard of a fused one) lands on this rank."""

    dim: int | None  # 0: output rows, 1: input columns, None: the whole tensor (replicated)
    dst: int  # offset in the local parameter along ``dim``
    src: int  # offset in the full checkpoint tensor along ``dim``
    size: int  # length along ``dim`` on this rank
    full: int  # length of the full checkpoint tensor along ``dim``


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice, without reading it."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def read_shard(loaded: Any, dim: int | None = None, start: int = 0, size: int = 0) -> torch.Tensor:
    """Read ``loaded[start:start+size]`` along ``dim`` (dim 0 or 1), or all of it (dim None).

    Works for tensors (returns a view) and safetensors slices (reads only that range).
    """
    if dim is None:
        return loaded if isinstance(loaded, torch.Tensor) else loaded[...]  # 0-dim too
    if dim == 0:
        return loaded[start : start + size]
    if dim == 1:
        return loaded[:, start : start + size]
    raise ValueError(f"dim={dim} is not supported: must be None, 0 or 1")


def check_shape(loaded: Any, expected: tuple[int, ...]) -> None:
    shape = loaded_shape(loaded)
    if shape != tuple(expected):
        raise ValueError(f"checkpoint tensor has shape {list(shape)}, expected {list(expected)}")


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator
