"""Can this ``generate`` call run on the paged engine? Judged from its arguments and the model,
before any preparation (what needs the prepared generation config is judged in ``prepare.py``).

``precheck`` returns a ``PagedFallback`` (not raised) so callers decide: the dispatcher runs stock,
``PagedModelForCausalLM`` raises its own error, the streaming pipeline takes the per-batch path.
"""

from __future__ import annotations

import torch

from hf_paged.engine.servable import quantization_reason
from hf_paged.integration.fallback import PagedFallback
from hf_paged.models import peft

_CACHE_KWARGS = ("past_key_values", "cache", "cache_params")


def precheck(model, args: dict, kwargs: dict, *, model_checks: bool = True) -> PagedFallback | None:
    """Why the call can't go paged, or None.

    Args:
        model: the HF model the call is on (for ``PagedModelForCausalLM``, its meta skeleton).
        args: ``generate``'s named arguments (``assistant_model``, ``custom_generate`` ...).
        kwargs: its other keyword arguments (generation options and model inputs).
        model_checks: also judge the model itself (device, dtype, weights); off for a
            ``PagedModelForCausalLM``, whose skeleton is on the meta device by design.
    """
    fb = _call_reason(model, args, kwargs)
    if fb is None and model_checks:
        fb = model_reason(model)
    return fb


def _call_reason(model, args: dict, kwargs: dict) -> PagedFallback | None:
    if args.get("custom_generate") is not None:
        return PagedFallback("custom_generate", "custom_generate replaces the decoding loop")
    if getattr(model.config, "is_encoder_decoder", False):
        return PagedFallback("encoder_decoder", "the model is an encoder-decoder")
    # assisted decoding runs on the engine's speculative steps (``assisted.py``), but for these
    if kwargs.get("assistant_tokenizer") is not None:
        return PagedFallback(
            "universal_assisted", "assistant_tokenizer= drafts with another tokenizer"
        )
    if kwargs.get("assistant_early_exit") is not None:
        return PagedFallback(
            "assistant_early_exit", "assistant_early_exit drafts with the model's own layers"
        )
    if args.get("assistant_model") is not None and args["assistant_model"] is model:
        return PagedFallback("assisted_self", "assistant_model is the model itself")
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        return PagedFallback("past_key_values", "a cache was passed in")
    if args.get("synced_gpus"):
        return PagedFallback("synced_gpus", "synced_gpus=True")
    if args.get("negative_prompt_ids") is not None or (
        args.get("negative_prompt_attention_mask") is not None
    ):
        return PagedFallback("guidance_scale", "a negative prompt needs a second model pass")
    if kwargs.get("inputs_embeds") is not None:
        return PagedFallback("inputs_embeds", "inputs_embeds were passed")
    if kwargs.get("cache_implementation") == "paged":
        return PagedFallback(
            "cache_implementation", "cache_implementation='paged' selects transformers' own"
        )
    return None


def model_reason(model) -> PagedFallback | None:
    """Why the engine can't serve ``model`` (an HF causal LM or a ``PeftModel``), or None."""
    from hf_paged.layers.quantization.fp8_config import fp8_param_names
    from hf_paged.models.registry import model_class_reason

    quantized = quantization_reason(model)
    if quantized is not None:
        return PagedFallback(*quantized)
    reason = peft.unsupported_reason(model)
    if reason is not None:
        return PagedFallback(*reason)
    model = peft.unwrap(model)  # a PeftModel: the HF model inside serves its calls
    why = model_class_reason(type(model), model.config)
    if why is not None:
        return PagedFallback("architecture", why)
    adapter_only = peft.adapter_parameter_names(model) if peft.tuner_modules(model) else set()
    skip = set(adapter_only) | fp8_param_names(model)  # FP8 weights and scales: their own dtypes
    served = [p for n, p in model.named_parameters() if n not in skip]
    devices = {p.device for p in served}
    dtypes = {p.dtype for p in served}
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(devices) != 1 or len(set(device_map.values())) > 1:
        return PagedFallback("device", "the model is spread over several devices")
    (device,), dtype = devices, next(iter(dtypes))
    if device.type not in ("cpu", "cuda"):
        return PagedFallback("device", f"the model is on {device.type}")
    ok = (torch.float32, torch.bfloat16) if device.type == "cpu" else (
        torch.float32, torch.float16, torch.bfloat16,
    )  # fmt: skip
    if len(dtypes) != 1 or dtype not in ok:
        return PagedFallback(
            "dtype", f"the engine does not run {sorted(map(str, dtypes))} on {device.type}"
        )
    dropout = (getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0 or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )
    if model.training and dropout:
        return PagedFallback("training_mode", "the model is in training mode with dropout")
    return None
