"""Give a meta-built HF model (``build.py``) its weights.

* An in-memory HF model of the same class: each parameter and buffer takes the source's tensor
  by name, sharing its storage when device and dtype already match (no second copy); otherwise
  a converted copy. Tied parameters stay tied (they are one Parameter object, filled once).
* A checkpoint directory: safetensors read lazily with transformers' key renames for the model
  (``WeightRenaming`` from its checkpoint conversion mapping) when every key maps one-to-one
  onto a parameter; a checkpoint that needs merging (``WeightConverter``: per-expert MoE weights
  into 3-D tensors...) is loaded by transformers' own ``from_pretrained`` and then shared as an
  in-memory model.

``refresh_weights`` copies ``(name, tensor)`` pairs into the engine's parameters, in place (a
fused group's members are views of its one buffer, so the fused weight follows), skipping a
tensor that is the parameter's own storage (adopted at load).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from hf_paged.models.loader import safetensors_files


def load_from_module(model: nn.Module, source: nn.Module, device: torch.device, rules=None,
                     params: dict | None = None) -> None:  # fmt: skip
    """Fill ``model``'s parameters and persistent/non-persistent buffers from ``source``.

    Args:
        params: ``{HF name: tensor}`` to load instead of ``source``'s own parameters (a PEFT
            model's merged or base weights, ``models/loader.iter_model_weights``).

    Raises:
        ValueError: ``source`` lacks a parameter ``model`` has, a shape differs, or a source
            tensor is on the meta device (offloaded).
    """
    src_params = params if params is not None else dict(
        source.named_parameters(remove_duplicate=False))  # fmt: skip
    src_buffers = dict(source.named_buffers(remove_duplicate=False))
    missing = []
    with torch.no_grad():
        for names in tied_groups(model):
            src = src_params.get(names[0])
            if src is None:
                missing.append(names[0])
                continue
            param = model.get_parameter(names[0])
            rule = (rules or {}).get(names[0])
            if rule is not None:  # this rank's part (a copy)
                src = rule.apply(src.detach())
            dtype = _target_dtype(model, names[0], param, src)
            set_parameter(model, names, _adopt(names[0], src, param, device, dtype))
        for name, buf in model.named_buffers():
            src = src_buffers.get(name)
            if src is not None and src.shape == buf.shape:
                buf.copy_(src.to(buf.device))
    if missing:
        raise ValueError(f"the in-memory model lacks parameters {missing[:8]}")


def refresh_weights(model: nn.Module, weights, rules=None, dry_run: bool = False) -> int:
    """Copy ``(parameter name, full tensor)`` pairs into ``model``'s parameters (this rank's part
    under ``rules``), in place; returns how many were (``dry_run``: would be, with nothing
    written) copied.

    Raises:
        ValueError: a name ``model`` lacks or a shape that does not fit.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    copied = 0
    with torch.no_grad():
        for name, src in weights:
            param = params.get(name)
            if param is None:
                raise ValueError(f"{name!r} is not a parameter of this model")
            if src.data_ptr() == param.data_ptr():
                continue  # adopted at load: the engine computes with the source itself
            rule = (rules or {}).get(name)
            value = rule.apply(src.detach()) if rule is not None else src.detach()
            if tuple(value.shape) != tuple(param.shape):
                raise ValueError(f"{name!r}: shape {tuple(value.shape)} does not fit")
            if not dry_run:
                param.copy_(value)
            copied += 1
    return copied


def tied_groups(model: nn.Module) -> list[list[str]]:
    """Parameter names grouped by Parameter object (a tied pair is one group of two)."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return list(groups.values())


def set_parameter(model: nn.Module, names: list[str], tensor: torch.Tensor) -> None:
    """Make ``tensor`` the parameter at every name in ``names`` (one object, so ties hold)."""
    param = tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, False)
    for name in names:
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner)._parameters[leaf] = param


def _target_dtype(model: nn.Module, name: str, param: torch.Tensor, src: torch.Tensor):
    """The model's dtype, except where the source keeps a module in fp32 as the class asks
    (``_keep_in_fp32_modules``), as ``from_pretrained`` does."""
    keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
    keep |= set(getattr(model, "_keep_in_fp32_modules_strict", None) or ())
    if src.dtype == torch.float32 and any(k in name.split(".") for k in keep):
        return torch.float32
    return param.dtype


def _adopt(name: str, src: torch.Tensor, param: torch.Tensor, device, dtype) -> torch.Tensor:
    if src.device.type == "meta":
        raise ValueError(f"{name!r} of the HF model is on the meta device (offloaded?)")
    if tuple(src.shape) != tuple(param.shape):
        raise ValueError(f"{name!r}: shape {tuple(src.shape)} != the model's {tuple(param.shape)}")
    if src.device == device and src.dtype == dtype:
        return src  # the source's own Parameter: shared storage and in-place updates
    return src.detach().to(device=device, dtype=dtype)


def load_from_checkpoint(
    model: nn.Module, path: str | os.PathLike, device, dtype, rules=None
) -> None:
    """Fill ``model`` from a safetensors checkpoint directory (see the module docstring).

    Raises:
        FileNotFoundError: no safetensors checkpoint at ``path``.
        ValueError: weights missing from, or unknown to, the checkpoint.
    """
    files = safetensors_files(path)
    plan = _rename_plan(model, files)
    if plan is None:  # needs transformers' merging converters
        _load_via_transformers(model, path, device, dtype, rules)
        return
    from safetensors import safe_open

    groups = {name: names for names in tied_groups(model) for name in names}
    buffers = dict(model.named_buffers())
    loaded = set()
    with torch.no_grad():
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    target = plan.get(key)
                    if target is None or target in loaded:
                        continue
                    tensor = f.get_tensor(key)
                    rule = (rules or {}).get(target)
                    if rule is not None:
                        tensor = rule.apply(tensor)
                    if target in groups:
                        dtype_p = model.get_parameter(target).dtype
                        set_parameter(model, groups[target], tensor.to(device, dtype_p))
                        loaded.update(groups[target])
                    elif target in buffers:
                        buffers[target].copy_(tensor)
                        loaded.add(target)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    if missing:
        raise ValueError(f"checkpoint does not match the model; missing weights: {missing[:8]}")


def _rename_plan(model: nn.Module, files: list[Path]) -> dict[str, str] | None:
    """checkpoint key -> parameter/buffer name, or None when some key needs a converter."""
    from safetensors import safe_open

    try:  # transformers >= 5's conversion mapping; older ones load through from_pretrained
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            rename_source_key,
        )
    except ImportError:
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    state = dict(model.state_dict(keep_vars=True))
    prefix = getattr(model, "base_model_prefix", None)
    plan: dict[str, str] = {}
    unknown = []
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            keys = list(f.keys())
        for key in keys:
            try:
                name, pattern = rename_source_key(key, renamings, converters, prefix, state)
            except TypeError:  # another signature: let from_pretrained do it
                return None
            if pattern is not None:
                return None
            if name in state:
                plan[key] = name
            else:
                unknown.append(key)
    if unknown:
        raise ValueError(f"checkpoint does not match the model; unexpected weights: {unknown[:8]}")
    return plan


def _load_via_transformers(model: nn.Module, path, device, dtype, rules=None) -> None:
    src = type(model).from_pretrained(
        os.fspath(path), dtype=dtype, device_map=str(device), attn_implementation="eager"
    )
    load_from_module(model, src, torch.device(device), rules)
