"""Can this ``generate`` call run on the paged engine? Judged from its arguments and the model,
before any preparation (what needs the prepared generation config is judged in ``prepare.py``).

``generate_refusal`` returns a ``Refusal`` (not raised) so callers decide: the dispatcher runs stock,
``PagedModelForCausalLM`` raises its own error, the streaming pipeline takes the per-batch path.
What no engine serves at all (quantization, PEFT) is ``models.servable``'s judgement, the one the
engine raises as ``ValueError``; this module adds what a stock twin of the call can tell apart
(the model's class, device, dtype, training mode).
"""

from __future__ import annotations

import torch

from hf_paged.models import peft
from hf_paged.models.servable import servable_refusal
from hf_paged.refusal import Refusal


def generate_refusal(
    model, args: dict, kwargs: dict, *, model_checks: bool = True
) -> Refusal | None:
    """Why the call can't go paged, or None.

    Args:
        model: the HF model the call is on (for ``PagedModelForCausalLM``, its meta skeleton).
        args: ``generate``'s named arguments (``assistant_model``, ``custom_generate`` ...).
        kwargs: its other keyword arguments (generation options and model inputs).
        model_checks: also judge the model itself (device, dtype, weights); off for a
            ``PagedModelForCausalLM``, whose skeleton is on the meta device by design.
    """
    refusal = _call_refusal(model, args, kwargs)
    if refusal is None and model_checks:
        refusal = model_refusal(model)
    return refusal


def _call_refusal(model, args: dict, kwargs: dict) -> Refusal | None:
    if args.get("custom_generate") is not None:
        return Refusal("custom_generate", "custom_generate replaces the decoding loop")
    if getattr(model.config, "is_encoder_decoder", False):
        return Refusal("encoder_decoder", "the model is an encoder-decoder")
    # assisted decoding runs on the engine's speculative steps (``assisted.py``), but for these
    if kwargs.get("assistant_tokenizer") is not None:
        return Refusal("universal_assisted", "assistant_tokenizer= drafts with another tokenizer")
    if kwargs.get("assistant_early_exit") is not None:
        return Refusal(
            "assistant_early_exit", "assistant_early_exit drafts with the model's own layers"
        )
    if args.get("assistant_model") is not None and args["assistant_model"] is model:
        return Refusal("assisted_self", "assistant_model is the model itself")
    if args.get("synced_gpus"):
        return Refusal("synced_gpus", "synced_gpus=True")
    if args.get("negative_prompt_ids") is not None or (
        args.get("negative_prompt_attention_mask") is not None
    ):
        return Refusal("guidance_scale", "a negative prompt needs a second model pass")
    if kwargs.get("cache_implementation") == "paged":
        return Refusal(
            "cache_implementation", "cache_implementation='paged' selects transformers' own"
        )
    return None


def model_refusal(model) -> Refusal | None:
    """Why the engine can't serve ``model`` (an HF causal LM or a ``PeftModel``) as stock runs
    it, or None."""
    from hf_paged.layers.quantization.fp8_config import fp8_param_names
    from hf_paged.models.registry import model_class_refusal

    refusal = servable_refusal(model)
    if refusal is not None:
        return refusal
    model = peft.unwrap(model)  # a PeftModel: the HF model inside serves its calls
    refusal = model_class_refusal(type(model), model.config)
    if refusal is not None:
        return refusal
    adapter_only = peft.adapter_parameter_names(model) if peft.tuner_modules(model) else set()
    skip = set(adapter_only) | fp8_param_names(model)  # FP8 weights and scales: their own dtypes
    served = [p for n, p in model.named_parameters() if n not in skip]
    devices = {p.device for p in served}
    dtypes = {p.dtype for p in served}
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(devices) != 1 or len(set(device_map.values())) > 1:
        return Refusal("device", "the model is spread over several devices")
    (device,), dtype = devices, next(iter(dtypes))
    if device.type not in ("cpu", "cuda"):
        return Refusal("device", f"the model is on {device.type}")
    ok = (torch.float32, torch.bfloat16) if device.type == "cpu" else (
        torch.float32, torch.float16, torch.bfloat16,
    )  # fmt: skip
    if len(dtypes) != 1 or dtype not in ok:
        return Refusal(
            "dtype", f"the engine does not run {sorted(map(str, dtypes))} on {device.type}"
        )
    dropout = (getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0 or any(
        isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()
    )
    if model.training and dropout:
        return Refusal("training_mode", "the model is in training mode with dropout")
    return None
