"""One LoRA adapter as the engine holds it: per adapted HF module its factors ``A [r, in]``,
``B [out, r]`` and scaling, under a key that names it and digests its weights.

Adapters come from a live PEFT model (``from_peft_layers``: the model's own tensors, no copy) or
from a directory saved by ``save_pretrained`` (``load_adapter_dir``). The key is
``"name@<digest>"``: the digest covers every factor's bytes and scaling, so an adapter reloaded
under the same name with new weights is a new key (the prefix cache and the device slots see a
new adapter).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LoraFactors:
    """One module's LoRA: ``delta(x) = (x @ a.T) @ b.T * scale``."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    """A named set of per-module factors (HF module names such as
    ``model.layers.0.self_attn.q_proj``)."""

    name: str
    layers: dict[str, LoraFactors]
    source: str | None = None  # the directory it was loaded from, if any
    digest: str = field(default="")

    def __post_init__(self):
        if not self.digest:
            self.digest = digest_of(self.layers)

    @property
    def key(self) -> str:
        """Its identity for the device slots and the prefix cache: name plus weight digest."""
        return f"{self.name}@{self.digest[:16]}"

    @property
    def rank(self) -> int:
        return max((f.rank for f in self.layers.values()), default=0)

    @property
    def dtype(self) -> torch.dtype | None:
        return next((f.a.dtype for f in self.layers.values()), None)


def digest_of(layers: dict[str, LoraFactors]) -> str:
    """sha256 over every module name, scaling and factor's bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(layers):
        f = layers[name]
        h.update(f"{name}|{f.scale!r}|{tuple(f.a.shape)}|{tuple(f.b.shape)}|{f.a.dtype}".encode())
        for t in (f.a, f.b):
            h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def combined(name: str, parts: list[LoraAdapter]) -> LoraAdapter:
    """Several adapters applied together (PEFT's several active adapters, whose deltas add): per
    module the factors stacked along the rank, each part's scaling folded into its ``B``."""
    if len(parts) == 1:
        return parts[0]
    layers: dict[str, LoraFactors] = {}
    for module in sorted({m for p in parts for m in p.layers}):
        fs = [p.layers[module] for p in parts if module in p.layers]
        a = torch.cat([f.a for f in fs], dim=0)  # [sum r, in]
        b = torch.cat([f.b * f.scale for f in fs], dim=1)  # [out, sum r]
        layers[module] = LoraFactors(a, b, 1.0)
    return LoraAdapter(name, layers)


# ---- from a live PEFT model -----------------------------------------------------------------


def from_peft_layers(name: str, tuners: dict, adapters: tuple[str, ...] | None) -> LoraAdapter:
    """The adapter PEFT's forward applies, from ``{module name: lora.Linear}``.

    Args:
        name: the key's name part.
        adapters: the adapter names to apply in every layer that has them (a row's
            ``adapter_names`` entry); None = each layer's active adapters (unless disabled).
    """
    per: dict[str, list[LoraFactors]] = {}
    for module_name, m in tuners.items():
        if adapters is None:
            chosen = [] if m.disable_adapters else list(m.active_adapters)
        else:
            chosen = list(adapters)
        fs = [
            LoraFactors(m.lora_A[a].weight.detach(), m.lora_B[a].weight.detach(),
                        float(m.scaling[a]))
            for a in chosen if a in m.lora_A
        ]  # fmt: skip
        if fs:
            per[module_name] = fs
    if all(len(fs) == 1 for fs in per.values()):
        return LoraAdapter(name, {k: fs[0] for k, fs in per.items()}, digest=_fast_digest(per))
    parts = [LoraAdapter(f"{name}#{i}", {k: fs[i] for k, fs in per.items() if len(fs) > i})
             for i in range(max(len(fs) for fs in per.values()))]  # fmt: skip
    return combined(name, parts)


def _fast_digest(per: dict[str, list[LoraFactors]]) -> str:
    """The digest of a live adapter, cached by a stamp of its tensors that moves on any write:
    storage and in-place versions, the optimizer steps seen (fused steps bump no version) and a
    probe of a few elements of each factor (writes through ``.data``; ``models/weight_stamp.py``).
    The bytes are hashed again only when the stamp moved."""
    from hf_paged.models import weight_stamp

    keys = sorted(per)
    stamp = tuple(
        (k, f.scale, f.a.data_ptr(), f.a._version, f.b.data_ptr(), f.b._version, f.a.dtype)
        for k in keys for f in per[k]
    ) + (weight_stamp.optimizer_steps(),
         weight_stamp.probe([t for k in keys for f in per[k] for t in (f.a, f.b)]))  # fmt: skip
    digest = _DIGESTS.get(stamp)
    if digest is None:
        digest = digest_of({k: fs[0] for k, fs in per.items()})
        if len(_DIGESTS) > 256:
            _DIGESTS.clear()
        _DIGESTS[stamp] = digest
    return digest


_DIGESTS: dict[tuple, str] = {}


# ---- from a directory -------------------------------------------------------------------------

_KEY = re.compile(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])\.(?:[^.]+\.)?weight$")


def load_adapter_dir(name: str, path: str | os.PathLike) -> LoraAdapter:
    """A LoRA adapter saved by PEFT's ``save_pretrained`` (``adapter_config.json`` plus
    ``adapter_model.safetensors``).

    Raises:
        ValueError: not such a directory, or what the engine does not serve (another PEFT
            type, DoRA, bias, modules_to_save, embedding LoRA); the message names the adapter.
    """
    path = os.fspath(path)
    cfg_path = os.path.join(path, "adapter_config.json")
    weights = os.path.join(path, "adapter_model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(weights)):
        raise ValueError(
            f"LoRA adapter {name!r}: path={path!r} is not a saved PEFT adapter (needs "
            "adapter_config.json and adapter_model.safetensors); save it with save_pretrained"
        )
    with open(cfg_path) as f:
        cfg = json.load(f)
    problem = _config_problem(cfg)
    if problem is not None:
        raise ValueError(f"LoRA adapter {name!r} at {path!r} is not served: {problem}")
    from safetensors.torch import load_file

    tensors = load_file(weights)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None and ("lora_embedding_" in key or ".base_layer." in key):
            module = key.removeprefix("base_model.model.").split(".lora_embedding_")[0]
            raise ValueError(f"LoRA adapter {name!r} at {path!r} targets modules the engine does "
                             f"not wrap: {module.split('.base_layer')[0]!r} (LoRA on an "
                             "embedding or the output head); LoRA is served on the decoder's "
                             "projections")  # fmt: skip
        if m is None:
            raise ValueError(f"LoRA adapter {name!r} at {path!r} is not served: it holds "
                             f"{key!r}, which is no lora_A/lora_B weight")  # fmt: skip
        pairs.setdefault(m.group(1), {})[m.group(2)] = t
    layers = {}
    for module, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {name!r}: {module!r} lacks lora_A or lora_B")
        r = ab["A"].shape[0]
        alpha = _pattern(cfg.get("alpha_pattern") or {}, module, cfg.get("lora_alpha", 8))
        scale = alpha / (r**0.5 if cfg.get("use_rslora") else r)
        layers[module] = LoraFactors(ab["A"], ab["B"], float(scale))
    return LoraAdapter(name, layers, source=path)


def _config_problem(cfg: dict) -> str | None:
    if cfg.get("peft_type", "LORA") != "LORA":
        return f"peft_type={cfg.get('peft_type')!r}; only LORA adapters are served"
    if cfg.get("use_dora"):
        return "use_dora=True (DoRA is not plain LoRA)"
    if cfg.get("bias", "none") != "none":
        return f"bias={cfg.get('bias')!r}; only bias='none' is served"
    if cfg.get("modules_to_save"):
        return f"modules_to_save={cfg['modules_to_save']!r} (full module copies are not slots)"
    variant = [k for k in ("use_alora", "alora_invocation_tokens") if cfg.get(k)]
    if variant:
        return f"{variant[0]} is set (a LoRA variant)"
    return None


def _pattern(patterns: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key matching the module
    name's tail."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default
