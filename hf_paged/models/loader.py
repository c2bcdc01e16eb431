"""Load HF weights into a native model, each rank reading only its own shard.

Checkpoint names map to our parameters one-to-one except the fused projections, which the
model's ``packed_modules_mapping`` routes (``...self_attn.q_proj.weight`` ->
``...self_attn.qkv_proj.weight`` shard "q"). Every parameter's ``weight_loader`` receives either
a lazy safetensors slice (it reads only the rows/cols its rank holds) or, for an in-memory HF
model, that model's tensor.

An in-memory model with PEFT adapters is read through ``iter_model_weights``: LoRA merged
into new tensors under the plain names, so the adapters apply and the user's model is unchanged.

In-memory loads share storage wherever the layouts are identical (same shape, dtype and device
and not a fused shard: at tp_size 1 that is everything but qkv_proj and gate_up_proj), so the
engine adds no second copy of those weights next to the HF model; fused ones are copied.
``refresh_weights`` copies ``(checkpoint name, tensor)`` pairs (an in-memory model's changed
weights, or new weights sent to every rank) into the parameters they load into, in place (same
storage, so captured CUDA graphs stay valid), skipping a tensor that is the parameter's own
storage (shared at load).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hf_paged.layers.quantization.fp8_config import SCALE_NAMES, plain_fp8_modules

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # old checkpoints saved this non-persistent buffer
# a tied head's tensors some checkpoints still store (FP8: its scales, which stock leaves unused)
_TIED_HEAD = {f"lm_head.{n}" for n in ("weight", *SCALE_NAMES)}


class _Router:
    """Maps checkpoint names to ``(param_name, shard_id)`` and tracks what was loaded."""

    def __init__(self, model: nn.Module):
        self.params = dict(model.named_parameters())  # tied weights appear once
        self.mapping: dict[str, tuple[str, Any]] = getattr(model, "packed_modules_mapping", {})
        self.tied = bool(getattr(model, "tie_word_embeddings", False))
        self.expected: dict[tuple[str, Any], str] = {}  # (param, shard) -> checkpoint name
        for name, param in self.params.items():
            for shard_id in getattr(param, "shard_ids", None) or (None,):
                self.expected[(name, shard_id)] = self._checkpoint_name(name, shard_id)
        self.loaded: set[tuple[str, Any]] = set()
        self.unexpected: list[str] = []

    def _checkpoint_name(self, name: str, shard_id: Any) -> str:
        for hf_module, (packed, sid) in self.mapping.items():
            if shard_id is not None and sid == shard_id and f".{packed}." in name:
                return name.replace(f".{packed}.", f".{hf_module}.")
        return name

    def route(self, hf_name: str) -> tuple[str, Any] | None:
        """``(param_name, shard_id)``, or None for names that are skipped or unexpected."""
        if hf_name.endswith(_IGNORED_SUFFIXES):
            return None
        if self.tied and hf_name in _TIED_HEAD:
            return None
        for hf_module, (packed, shard_id) in self.mapping.items():
            if f".{hf_module}." in hf_name:
                name = hf_name.replace(f".{hf_module}.", f".{packed}.")
                if name in self.params:
                    return name, shard_id
        if hf_name in self.params:
            return hf_name, None
        self.unexpected.append(hf_name)
        return None

    def load(self, hf_name: str, loaded: Any) -> None:
        target = self.route(hf_name)
        if target is None:
            return
        name, shard_id = target
        param = self.params[name]
        if _can_share(param, loaded, shard_id):
            param.data = loaded.detach()
        else:
            _load(param, param, loaded, shard_id, f"loading {hf_name!r} into {name!r}")
        self.loaded.add(target)

    def check_complete(self) -> None:
        missing = sorted(hf for key, hf in self.expected.items() if key not in self.loaded)
        if missing or self.unexpected:
            parts = []
            if missing:
                parts.append(f"missing weights: {missing}")
            if self.unexpected:
                parts.append(f"unexpected weights: {sorted(self.unexpected)}")
            raise ValueError("checkpoint does not match the model; " + "; ".join(parts))


def _can_share(param: nn.Parameter, loaded: Any, shard_id: Any) -> bool:
    """An in-memory tensor whose layout is exactly ours: use it instead of copying it."""
    return (
        isinstance(loaded, torch.Tensor)
        and shard_id is None
        and loaded.shape == param.shape
        and loaded.dtype == param.dtype
        and loaded.device == param.device
        and loaded.is_contiguous()
    )


def safetensors_files(path: str | os.PathLike) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded index or single file).

    Raises:
        FileNotFoundError: no ``model.safetensors(.index.json)`` there.
    """
    path = Path(path)
    if path.is_file():
        return [path]
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise FileNotFoundError(
        f"no model.safetensors or model.safetensors.index.json in {str(path)!r}"
    )


def _iter_safetensors(path: str | os.PathLike) -> Iterator[tuple[str, Any]]:
    from safetensors import safe_open

    for file in safetensors_files(path):
        try:
            f = safe_open(str(file), framework="pt", device="cpu")
        except FileNotFoundError:
            raise
        except Exception as e:  # SafetensorError (truncated, corrupt) does not name the file
            raise ValueError(
                f"cannot read the checkpoint file {str(file)!r}: {e}. The file is truncated or "
                "corrupt (an interrupted download or copy?): fetch or save it again"
            ) from e
        with f:
            for name in f.keys():
                yield name, f.get_slice(name)  # lazy: the weight_loader reads its shard


class BaseWeights:
    """An in-memory PEFT model as a weight source without its LoRA merged: the base weights
    under the plain names (the engine serves the adapters from slots, ``models/adapters``)."""

    def __init__(self, model: nn.Module):
        self.model = model


def iter_model_weights(
    hf_model: nn.Module, names: set[str] | None = None, merge_lora: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(checkpoint name, tensor)`` for the weights an in-memory HF model computes with (only
    those in ``names`` when given).

    A plain model yields its own parameters (storage shared). A model with PEFT adapters (a
    ``PeftModel``, or adapters injected into the HF model) yields the weights PEFT's forward
    applies under the plain names: LoRA merged into new tensors, the model left unchanged
    (``hf_paged.models.peft``); with ``merge_lora=False`` the base weights alone (the engine
    serves the LoRA from slots).

    Raises:
        ValueError: a weight on the meta device, or adapters the merge can't reproduce.
    """
    from hf_paged.models import peft  # imports peft only where the process already has

    if peft.is_peft_model(hf_model) or peft.tuner_modules(hf_model):
        items = peft.merged_weights(hf_model, names) if merge_lora else peft.base_weights(hf_model)
    else:
        items = hf_model.named_parameters()
    unused = _unused_fp8_scales(peft.unwrap(hf_model))
    for name, tensor in items:
        if name in unused or (names is not None and name not in names):
            continue
        if tensor.device.type == "meta":
            raise ValueError(f"{name!r} of the HF model is on the meta device (offloaded?)")
        yield name, tensor


def _unused_fp8_scales(hf_model: nn.Module) -> set[str]:
    """FP8 scales of modules whose weight is plain (a tied head, or a weight transformers'
    quantizer could not block): its ``FP8Linear`` computes with such a weight plainly."""
    return {f"{m}.{s}" for m in plain_fp8_modules(hf_model) for s in SCALE_NAMES}


def load_weights(model: nn.Module, source: str | os.PathLike | nn.Module) -> None:
    """Fill ``model``'s parameters from a checkpoint directory or an in-memory HF model.

    Args:
        model: a native model (e.g. ``LlamaForCausalLM``) built on the target dtype and device.
        source: a directory holding ``model.safetensors`` or ``model.safetensors.index.json``
            (or one ``.safetensors`` file), or a ``transformers.PreTrainedModel``.

    Raises:
        ValueError: the checkpoint lacks weights the model needs or has ones it does not know
            (both listed by checkpoint name), or a tensor has the wrong shape.
        FileNotFoundError: no safetensors checkpoint at ``source``.
    """
    router = _Router(model)
    if isinstance(source, BaseWeights):
        items = iter_model_weights(source.model, merge_lora=False)
    elif isinstance(source, nn.Module):
        items = iter_model_weights(source)
    else:
        items = _iter_safetensors(source)
    with torch.no_grad():
        for hf_name, loaded in items:
            router.load(hf_name, loaded)
    router.check_complete()


def refresh_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], dry_run: bool = False
) -> int:
    """Copy ``(checkpoint name, full tensor)`` pairs into the parameters ``load_weights`` fills
    from those names (this rank's part), in place; a tensor that is the parameter's own storage
    is skipped. Returns how many tensors were (``dry_run``: would be) copied.

    ``dry_run`` runs every loader on meta copies: names and shapes are judged, nothing is
    written (so a bad pair fails before any rank has changed a weight).

    Raises:
        ValueError: a name the model does not have, or a shape that does not fit.
    """
    router = _Router(model)
    copied = 0
    with torch.no_grad():
        for hf_name, loaded in weights:
            target = router.route(hf_name)
            if target is None:
                if router.unexpected:
                    raise ValueError(f"{router.unexpected[-1]!r} is not a weight of this model")
                continue
            name, shard_id = target
            param = router.params[name]
            if shard_id is None and loaded.data_ptr() == param.data_ptr():
                continue  # shared at load: the engine computes with the source itself
            dst = torch.empty_like(param, device="meta") if dry_run else param
            src = loaded.to("meta") if dry_run else loaded
            _load(param, dst, src, shard_id, f"{hf_name!r} does not fit {name!r}")
            copied += 1
    return copied


def _load(param, dst, src, shard_id, what: str) -> None:
    """``param``'s weight loader copies ``src`` into ``dst`` (one shard of a fused weight when
    ``shard_id`` names it); a shape it refuses is a ``ValueError`` that starts with ``what``."""
    try:
        if shard_id is None:
            param.weight_loader(dst, src)
        else:
            param.weight_loader(dst, src, shard_id)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from e
