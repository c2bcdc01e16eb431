"""Which ``RecurrentMixer`` serves which HF recurrent layer class (a lazy registry).

``MIXERS`` maps an HF module class name to ``"module:Class"`` in this package, imported only
when a model has such a layer; ``None`` marks a recurrent layer class that no mixer serves yet
(the generic path refuses its model by name). A new mixer registers with one line per HF class.
"""

from __future__ import annotations

import importlib

from torch import nn

from hf_paged.models.recurrent.base import RecurrentMixer

MIXERS: dict[str, str | None] = {
    # Gated DeltaNet
    "Qwen3NextGatedDeltaNet": "gated_delta:GatedDeltaNetMixer",
    "Qwen3_5GatedDeltaNet": "gated_delta:GatedDeltaNetMixer",
    "Qwen3_5MoeGatedDeltaNet": "gated_delta:GatedDeltaNetMixer",
    "OlmoHybridGatedDeltaNet": "gated_delta:GatedDeltaNetMixer",
    "LaraMiniGatedDeltaNet": "gated_delta:GatedDeltaNetMixer",
    "Qwen4ExpTextGatedDeltaNet": None,
    "KimiLinearDeltaAttention": None,
    "BailingHybridDeltaAttention": None,
    # lightning attention
    "MiniMaxLightningAttention": "lightning:LightningAttentionMixer",
    # Mamba 1
    "MambaMixer": "mamba:MambaMixer",
    "FalconMambaMixer": "mamba:MambaMixer",
    "JambaMambaMixer": "mamba:MambaMixer",
    "ZambaMambaMixer": None,
    # Mamba 2
    "Mamba2Mixer": "mamba2:Mamba2Mixer",
    "FalconH1Mixer": "mamba2:Mamba2Mixer",
    "BambaMixer": "mamba2:Mamba2Mixer",
    "GraniteMoeHybridMambaLayer": "mamba2:Mamba2Mixer",
    "NemotronHMamba2Mixer": "mamba2:Mamba2Mixer",
    "Zamba2MambaMixer": None,
    # short convolutions
    "Lfm2ShortConv": "short_conv:ShortConvMixer",
    "Lfm2MoeShortConv": None,
    "Lfm3ShortConv": "short_conv:ShortConvMixer",
    # RG-LRU
    "RecurrentGemmaRecurrentBlock": "rglru:RGLRUMixer",
}  # fmt: skip


def is_recurrent(module: nn.Module) -> bool:
    """Whether ``module`` is an HF recurrent layer this registry knows (served or not)."""
    return type(module).__name__ in MIXERS


def mixer_class(hf_class_name: str) -> type[RecurrentMixer] | None:
    """The mixer class for ``hf_class_name``, or None (unknown, or no mixer yet)."""
    target = MIXERS.get(hf_class_name)
    if target is None:
        return None
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(f"hf_paged.models.recurrent.{module}"), name)


def recurrent_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(qualified name, module)`` of every known recurrent layer in ``model``, in module order
    (a recurrent layer's children are not searched)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if is_recurrent(module) and not any(name.startswith(f + ".") for f, _ in found):
            found.append((name, module))
    return found


def unserved(names: set[str] | list[str]) -> list[str]:
    """The class names among ``names`` that are recurrent layers with no mixer, sorted."""
    return sorted({n for n in names if n in MIXERS and MIXERS[n] is None})
