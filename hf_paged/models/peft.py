"""PEFT adapters on the paged engine: LoRA merged into engine-owned weights.

A ``PeftModel`` (or a transformers model with adapters loaded through ``load_adapter``) holds its
base weights inside PEFT's tuner layers (``...q_proj.base_layer.weight``) beside the adapter
factors (``...q_proj.lora_A.default.weight``). The engine serves the weights that PEFT's own
forward would apply, under the plain HF names (``...q_proj.weight``):

* a LoRA ``Linear`` / ``Embedding`` that is enabled and not merged: ``W + sum(scale * B @ A)``
  over its active adapters (PEFT's ``get_delta_weight``), computed into a new tensor, so the
  user's model is never mutated; its bias gains ``scale * lora_B.bias`` where ``lora_bias`` is on;
* one that is merged (``merge_adapter``): its base weight as it is (PEFT's forward skips the
  adapters then); one that is disabled (``disable_adapter()``): its base weight;
* a ``modules_to_save`` copy: the active adapter's copy, or the original when disabled.

When every tuner layer is plain unmerged LoRA on the projections the engine wraps, the engine
serves the adapters unmerged from LoRA slots instead (``models/adapters``): per-row
``adapter_names`` included, and adapter changes need no rebuild.

What the merged weights cannot reproduce is a ``Refusal`` (``unsupported_refusal``): prompt
learning (prompt/prefix/p-tuning), other tuner types (IA3, LoKr, OFT ...), LoRA variants (DoRA,
aLoRA ...), per-row ``adapter_names`` (unless served from slots), a disabled layer whose
adapter is merged (PEFT's forward would unmerge it, changing the weights), LoRA bias on a layer without one, and tuner layers on
tied weights. The dispatcher turns it into a stock fallback; ``LLM`` raises it as a ValueError.

``adapter_state`` is what the engine's weight watch can't see in the parameters (active adapter,
enabled, merged, scaling, hooks), so a change between calls rebuilds the engine; ``served_names``
says which served weights a parameter feeds, so an adapter trained in place refreshes only the
weights it is merged into.
Nothing here imports ``peft`` unless the caller's process already has.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

from hf_paged.refusal import Refusal

_LORA_BASE = "base_layer."


def _peft_types():
    """``(BaseTunerLayer, AuxiliaryTrainingWrapper, lora module)`` or None without peft."""
    if "peft" not in sys.modules:  # no adapter can exist in a process that never imported peft
        return None
    from peft.tuners import lora
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils.other import AuxiliaryTrainingWrapper

    return BaseTunerLayer, AuxiliaryTrainingWrapper, lora


def is_peft_model(model) -> bool:
    """``model`` is a ``PeftModel`` wrapper (not the HF model inside it)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftMixedModel, PeftModel

    return isinstance(model, (PeftModel, PeftMixedModel))


def unwrap(model):
    """The transformers model inside a ``PeftModel`` (its tuner layers stay in place); any
    other object unchanged."""
    return model.get_base_model() if is_peft_model(model) else model


def is_adapter_dir(path) -> bool:
    """A PEFT adapter directory (``adapter_config.json`` without a model ``config.json``),
    which transformers opens by loading the base model and then the adapter."""
    path = os.fspath(path)
    return os.path.isfile(os.path.join(path, "adapter_config.json")) and not os.path.isfile(
        os.path.join(path, "config.json")
    )


def tuner_modules(model: nn.Module) -> dict[str, nn.Module]:
    """``{module name: module}`` of every PEFT tuner layer and training wrapper in ``model``."""
    types = _peft_types()
    if types is None:
        return {}
    tuner, wrapper, _ = types
    return {n: m for n, m in model.named_modules() if isinstance(m, (tuner, wrapper))}


# ---- what can be served --------------------------------------------------------------------


def unsupported_refusal(model) -> Refusal | None:
    """Why merged weights can't reproduce the PEFT model's output, or None."""
    if is_peft_model(model):
        if any(c.is_prompt_learning for c in model.peft_config.values()):
            return _prompt_learning()
        model = unwrap(model)
    override = model.__dict__.get("prepare_inputs_for_generation")
    if override is not None:  # PeftModel.generate installs its own for prompt learning
        owner = getattr(override, "__self__", None)
        if is_peft_model(owner):
            return _prompt_learning()
        return Refusal(
            "prepare_inputs_override", "the model's prepare_inputs_for_generation is replaced"
        )
    tuners = tuner_modules(model)
    if not tuners:
        return None
    slots = unmerged_refusal(model, tuners) is None  # per-row adapter_names served from slots
    for name, module in tuners.items():
        reason = _layer_refusal(name, module, slots)
        if reason is not None:
            return reason
    return _tied_refusal(model, tuners)


def _prompt_learning() -> Refusal:
    return Refusal(
        "peft_prompt_learning",
        "the PEFT model uses prompt learning (prompt/prefix/p-tuning), which changes the "
        "inputs, not the weights",
    )


def _layer_refusal(name: str, module: nn.Module, slots: bool = False) -> Refusal | None:
    _, wrapper, lora = _peft_types()
    if isinstance(module, wrapper):
        if type(module).__name__ != "ModulesToSaveWrapper":
            kind = type(module).__name__.removesuffix("Wrapper")
            return Refusal(f"peft_{kind.lower()}", f"PEFT {type(module).__name__} on {name!r}")
    elif type(module) not in (lora.Linear, lora.Embedding):
        kind = _tuner_kind(module)
        return Refusal(f"peft_{kind}", f"PEFT {kind} layer {type(module).__name__} on {name!r}")
    elif module.disable_adapters and module.merged:
        return Refusal(
            "peft_disabled_merged",
            f"{name!r} has merged adapters {module.merged_adapters} but adapters are disabled "
            "(PEFT's forward would unmerge them)",
        )
    if (module._forward_pre_hooks or module._forward_hooks) and not slots:
        return Refusal("peft_adapter_names", f"forward hooks on {name!r} (per-row adapter_names?)")
    if not isinstance(module, wrapper) and not module.disable_adapters and not module.merged:
        return _lora_variant_refusal(name, module)
    return None


def _tuner_kind(module: nn.Module) -> str:
    """``"ia3"`` for ``peft.tuners.ia3.layer.Linear``; the class name otherwise."""
    parts = type(module).__module__.split(".")
    if len(parts) > 2 and parts[:2] == ["peft", "tuners"]:
        return parts[2]
    return type(module).__name__.lower()


def _lora_variant_refusal(name: str, module: nn.Module) -> Refusal | None:
    for adapter in _applied_adapters(module):
        variant = module.lora_variant.get(adapter)
        if variant is not None:
            kind = type(variant).__name__
            for suffix in ("LinearVariant", "EmbeddingVariant", "Variant"):
                kind = kind.removesuffix(suffix)
            return Refusal(
                f"peft_{kind.lower()}",
                f"adapter {adapter!r} on {name!r} is a {kind} LoRA variant, not plain LoRA",
            )
        if module.lora_bias.get(adapter) and getattr(module.get_base_layer(), "bias", None) is None:
            return Refusal(
                "peft_lora_bias", f"adapter {adapter!r} adds a bias to {name!r}, which has none"
            )
    return None


def _applied_adapters(module: nn.Module) -> list[str]:
    """The adapters a LoRA layer's forward adds now (enabled, unmerged, active, present)."""
    if module.disable_adapters or module.merged:
        return []
    present = module.lora_A.keys() if hasattr(module, "lora_A") else ()
    present = set(present) | set(getattr(module, "lora_embedding_A", {}).keys())
    return [a for a in module.active_adapters if a in present]


def _tied_refusal(model: nn.Module, tuners: dict[str, nn.Module]) -> Refusal | None:
    """A tuner layer on a weight that is tied to another (lm_head and embed_tokens): the
    engine holds one tensor for both, the PEFT model would adapt only one side."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    for names in names_of.values():
        if len(names) > 1 and any(_owner(n, tuners)[0] is not None for n in names):
            return Refusal("peft_tied_weights", f"a PEFT layer adapts tied weights {sorted(names)}")
    return None


# ---- LoRA served from slots (``models/adapters``) ----------------------------------------

# the projections the engine's LoRA slots wrap (their HF names' last part)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def unmerged_refusal(model, tuners: dict | None = None) -> Refusal | None:
    """Why the model's adapters can't be served from slots (then they are merged), or None.
    ``tuners``: ``tuner_modules`` of the model when the caller has them."""
    tuners = tuner_modules(unwrap(model)) if tuners is None else tuners
    if not tuners:
        return Refusal("no_adapters", "the model has no PEFT layers")
    _, _, lora = _peft_types()
    for name, m in tuners.items():
        if type(m) is not lora.Linear:
            return Refusal("lora_layer", f"{name!r} is a {type(m).__name__}, not a LoRA Linear")
        if name.rpartition(".")[2] not in LORA_TARGETS:
            return Refusal("lora_target", f"{name!r} is not a projection the engine wraps")
        if m.merged:
            return Refusal("lora_merged", f"{name!r} has merged adapters {m.merged_adapters}")
        if m.lora_variant or any(m.lora_bias.values()):
            return Refusal("lora_variant", f"{name!r} has a LoRA variant or a LoRA bias")
        hooks = (*m._forward_pre_hooks.values(), *m._forward_hooks.values())
        if any(not is_adapter_names_hook(h) for h in hooks):
            return Refusal("lora_hooks", f"forward hooks on {name!r}")
    return None


def is_adapter_names_hook(hook) -> bool:
    """PEFT's ``adapter_names`` pre-hook (a ``functools.partial`` PEFT installs per call)."""
    fn = getattr(hook, "func", None)
    return getattr(fn, "__name__", "") == "_adapter_names_pre_forward_hook"


# ---- fingerprint ---------------------------------------------------------------------------


def adapter_state(model: nn.Module) -> tuple:
    """Per tuner layer: active adapters, disabled, merged adapters, scaling and hook counts.
    Parameter versions cover the weights themselves; this covers what changes without them."""
    state = []
    for name, m in tuner_modules(model).items():
        scaling = getattr(m, "scaling", None) or {}
        state.append((
            name,
            tuple(m.active_adapters),
            bool(m.disable_adapters),
            tuple(getattr(m, "merged_adapters", ()) or ()),
            tuple(sorted((k, float(v)) for k, v in scaling.items())),
            len(m._forward_pre_hooks) + len(m._forward_hooks),
        ))  # fmt: skip
    return tuple(state)


def adapter_parameter_names(model: nn.Module) -> set[str]:
    """Names of parameters that only adapters use (LoRA factors, other adapters' copies,
    originals shadowed by a modules_to_save copy): the engine never loads them as such."""
    return {name for name, hf_name, _ in _classify(model) if hf_name is None}


# ---- merged weights --------------------------------------------------------------------------


def merged_weights(
    model: nn.Module, names: set[str] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for every weight PEFT's forward applies now (only those in
    ``names`` when given), under the names of the model without adapters. Adapted weights are
    new tensors (the model is not changed); the others are the model's own parameters.

    Raises:
        ValueError: ``unsupported_refusal`` refuses the model (its detail is the message).
    """
    model = unwrap(model)
    reason = unsupported_refusal(model)
    if reason is not None:
        raise ValueError(f"this PEFT model can't run on the paged engine: {reason.tagged()}")
    for _, hf_name, value in _classify(model):
        if hf_name is not None and (names is None or hf_name in names):
            yield hf_name, value() if callable(value) else value


def served_names(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """``{parameter name: served HF names it feeds}`` for every parameter of ``model`` (the
    unwrapped one): a LoRA factor feeds its layer's merged weight (and bias), a base weight its
    plain name, an unused copy nothing."""
    model = unwrap(model)
    tuners = tuner_modules(model)
    bases = {}
    for name, hf_name, _ in _classify(model):
        owner, _ = _owner(name, tuners)
        if hf_name is not None and owner is not None:
            bases.setdefault(owner, []).append(hf_name)
    out = {}
    for name, hf_name, _ in _classify(model):
        owner, rest = _owner(name, tuners)
        if hf_name is not None:
            out[name] = (hf_name,)
        elif owner is not None and rest.startswith(("lora_", "lora_embedding_")):
            out[name] = tuple(bases.get(owner, ()))  # folded into the layer's weight and bias
        else:
            out[name] = ()
    return out


def base_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` for the base weights of a model whose LoRA layers the engine serves
    from slots (``models/adapters``): every LoRA layer's base weight as it is, the factors left
    out; the model's own tensors, nothing copied."""
    model = unwrap(model)
    tuners = tuner_modules(model)
    for name, hf_name, value in _classify(model):
        if hf_name is None:
            continue
        owner, rest = _owner(name, tuners)
        if owner is not None and rest.startswith(_LORA_BASE):
            value = model.get_parameter(name)
        yield hf_name, value() if callable(value) else value


def _owner(name: str, tuners: dict[str, nn.Module]) -> tuple[str | None, str]:
    """``(tuner module name, rest of the parameter name)`` for the innermost tuner holding it."""
    best = None
    for t in tuners:
        if name.startswith(t + ".") and (best is None or len(t) > len(best)):
            best = t
    return (best, name[len(best) + 1 :]) if best is not None else (None, name)


def _classify(model: nn.Module):
    """``(name, HF name or None, tensor or zero-argument callable)`` per parameter of ``model``;
    HF name None for parameters that are not served; callables compute merged tensors lazily."""
    tuners = tuner_modules(model)
    _, wrapper, _ = _peft_types() or (None, (), None)
    for name, p in model.named_parameters():
        owner, rest = _owner(name, tuners)
        if owner is None:
            yield name, name, p
            continue
        module = tuners[owner]
        if isinstance(module, wrapper):
            yield name, _wrapped_name(owner, rest, module), p
        elif rest == _LORA_BASE + "weight":
            yield name, f"{owner}.weight", lambda m=module: _merged_weight(m)
        elif rest == _LORA_BASE + "bias":
            yield name, f"{owner}.bias", lambda m=module: _merged_bias(m)
        elif rest.startswith(_LORA_BASE):
            yield name, f"{owner}.{rest.removeprefix(_LORA_BASE)}", p
        else:
            yield name, None, p  # lora_A / lora_B / lora_embedding_*: folded into the weight


def _wrapped_name(owner: str, rest: str, module: nn.Module) -> str | None:
    """A modules_to_save wrapper's parameter under its plain name, if it is the one used."""
    active = module.active_adapters
    use_copy = not module.disable_adapters and active and all(a in module._adapters for a in active)
    chosen = f"modules_to_save.{active[0]}." if use_copy else "original_module."
    return f"{owner}.{rest.removeprefix(chosen)}" if rest.startswith(chosen) else None


@torch.no_grad()
def _merged_weight(module: nn.Module) -> torch.Tensor:
    """``W + sum(delta)`` over the adapters the layer's forward applies; ``W`` itself if none."""
    weight = module.get_base_layer().weight
    adapters = _applied_adapters(module)
    if not adapters:
        return weight
    merged = weight.detach().clone()
    for adapter in adapters:
        merged += module.get_delta_weight(adapter).to(merged.dtype)  # [out, in] like W
    return merged


@torch.no_grad()
def _merged_bias(module: nn.Module) -> torch.Tensor:
    bias = module.get_base_layer().bias
    adapters = [a for a in _applied_adapters(module) if module.lora_bias.get(a)]
    if not adapters:
        return bias
    merged = bias.detach().clone()
    for adapter in adapters:
        merged += (module.lora_B[adapter].bias * module.scaling[adapter]).to(merged.dtype)
    return merged
