"""What no paged engine can serve, whoever asks: quantized weights other than the FP8 formats the
engine runs, PEFT adapters that merged weights can't reproduce, and forward hooks of the caller's
on the model's modules (the engine runs its own modules).

One judgement, two outcomes: the engine (``LLM``, ``AutoPagedModelForCausalLM``, which have no
stock model to fall back on) raises it as ``ValueError`` through ``check_servable``; the
``generate`` dispatcher, pipelines and lm-eval turn the same ``Refusal`` into a stock call
(``integration/servable.py`` adds what only a stock twin of the call can tell: device, dtype,
training mode, the model class).

Here, below the engine, so that the engine and the front ends share it.
"""

from __future__ import annotations

import os

from hf_paged.models import peft
from hf_paged.models.forward_wrappers import instance_forward_refusal
from hf_paged.refusal import Refusal


def quantization_method(model_or_config) -> str | None:
    """The ``quant_method`` of a quantized model or config ("bitsandbytes", "gptq", "awq",
    "fp8" ...; "unknown" when it names none), or None for plain weights. Which of them the engine
    serves is ``layers.quantization.unserved_quantization``'s decision."""
    quantizer = getattr(model_or_config, "hf_quantizer", None)
    qc = getattr(quantizer, "quantization_config", None)
    config = getattr(model_or_config, "config", model_or_config)
    if qc is None:
        qc = getattr(config, "quantization_config", None)
    if not qc and not getattr(model_or_config, "is_quantized", False) and quantizer is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)  # transformers' QuantizationMethod enum
    return str(method) if method else "unknown"


def quantization_refusal(model_or_config) -> Refusal | None:
    """Why a model's or config's quantization can't be served (reason ``quantized_<method>``),
    or None (plain weights, or a served FP8 scheme)."""
    from hf_paged.layers.quantization import unserved_quantization

    found = unserved_quantization(model_or_config)
    if found is None:
        return None
    method, why = found
    return Refusal(
        f"quantized_{method}",
        f"quantization_config with quant_method={method!r} is not allowed: {why}; load an "
        "unquantized or FP8 checkpoint, or use transformers' own generate for this one",
    )


def checkpoint_refusal(path: str | os.PathLike) -> Refusal | None:
    """``quantization_refusal`` of a checkpoint directory's config (None for anything that is not
    a checkpoint directory: whoever opens it says what is wrong)."""
    from transformers import AutoConfig

    from hf_paged.paths import is_checkpoint_dir

    if not is_checkpoint_dir(path):
        return None
    return quantization_refusal(AutoConfig.from_pretrained(path))


def servable_refusal(model, hf_config=None) -> Refusal | None:
    """Why no engine can serve ``model`` (a checkpoint directory, whose ``hf_config`` is judged,
    an in-memory HF model or a ``PeftModel``), or None."""
    in_memory = not isinstance(model, (str, os.PathLike))
    quantized = quantization_refusal(model if in_memory else hf_config)
    if quantized is not None or not in_memory:
        return quantized
    return peft.unsupported_refusal(model) or hook_refusal(model)


# packages whose module classes the engine knows how to read (transformers' own and remote code,
# torch's building blocks, PEFT's LoRA wrappers, accelerate's, the FP8 / quantization layers)
_KNOWN_MODULE_PACKAGES = ("torch", "transformers", "transformers_modules", "peft", "accelerate",
                          "hf_paged", "compressed_tensors", "bitsandbytes", "optimum",
                          "kernels")  # fmt: skip


def _package(module) -> str:
    return type(module).__module__.split(".")[0]


def hook_refusal(model) -> Refusal | None:
    """A forward hook or pre-hook of the caller's on a module of ``model`` (steering vectors,
    logit lenses, recorders), a module whose ``forward`` was replaced on the instance by a
    wrapper that changes its outputs (``forward_wrappers.py`` reads the ones that don't), or a
    module of the caller's own class put into a stock architecture (a head or layer swapped for a
    subclass with its own forward): stock's forward runs them at every step, the engine's own
    modules never do. transformers' own hooks (output capturing, input grads) leave the values
    as they are and do not count, nor do accelerate's device hooks (``_hf_hook``: the device
    check judges those models)."""
    stock_class = _package(model) in _KNOWN_MODULE_PACKAGES  # else an architecture of the
    # caller's own (registered with the Auto classes): its own modules are its definition
    for name, module in model.named_modules():
        if stock_class and _package(module) not in _KNOWN_MODULE_PACKAGES:
            return Refusal(
                "custom_modules",
                f"{name or 'the model'!r} is a {type(module).__qualname__} (from "
                f"{type(module).__module__}), whose forward runs in stock's forward only: the "
                "engine runs its own modules from the model's weights",
            )
        if "forward" in vars(module) and not hasattr(module, "_hf_hook"):
            refusal = instance_forward_refusal(module, name)  # trainers' wrappers are read
            if refusal is not None:
                return refusal
        for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values()):
            # PEFT's per-row adapter names: ``models/peft.py`` judges them
            if peft.is_adapter_names_hook(hook):
                continue
            fn = getattr(hook, "func", hook)  # a functools.partial: the function inside
            if not getattr(fn, "__module__", "").startswith("transformers."):
                what = getattr(fn, "__qualname__", type(fn).__name__)
                return Refusal(
                    "module_hooks",
                    f"a forward hook ({what}) on {name or 'the model'!r} runs in stock's forward "
                    "only: remove it to serve the model paged",
                )
    return None


def check_servable(model, hf_config=None) -> None:
    """``servable_refusal`` raised, for callers with no stock model to fall back on.

    Raises:
        ValueError: naming the reason (a PEFT model's message says what the engine serves).
    """
    refusal = servable_refusal(model, hf_config)
    if refusal is None:
        return
    if refusal.reason.startswith("quantized_"):
        raise ValueError(refusal.tagged())
    if refusal.reason in ("module_hooks", "patched_forward", "custom_modules", "autocast"):
        raise ValueError(f"model=<{type(model).__name__}> is not allowed: {refusal.tagged()}")
    raise ValueError(
        f"model=<PEFT model> is not allowed: {refusal.tagged()}; the engine serves plain LoRA "
        "(merged into its weights); use the PEFT model's own generate"
    )


__all__ = [
    "check_servable",
    "checkpoint_refusal",
    "quantization_method",
    "quantization_refusal",
    "servable_refusal",
]
