"""Whether the engine can serve a model: the quantization and PEFT checks that ``LLMEngine``
raises as ``ValueError`` at start-up (``check_servable``). ``integration/servable.py`` asks the
same questions for the ``generate`` dispatcher, which falls back to stock instead."""

from __future__ import annotations

import os


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


def quantization_reason(model_or_config) -> tuple[str, str] | None:
    """``(reason, detail)`` when a model's or config's quantization is one the engine does not
    serve (``layers.quantization.unserved_quantization`` decides), else None; the message every
    caller shows, a fallback warning or a ValueError."""
    from hf_paged.layers.quantization import unserved_quantization

    found = unserved_quantization(model_or_config)
    if found is None:
        return None
    method, why = found
    return f"quantized_{method}", (
        f"quantization_config with quant_method={method!r} is not allowed: {why}; load an "
        "unquantized or FP8 checkpoint, or use transformers' own generate for this one"
    )


def check_servable(model, hf_config) -> None:
    """ValueError for what the engine can't run and ``LLM`` has no stock model to fall back
    on for: quantized weights other than the FP8 formats it serves, and PEFT adapters that
    merged weights can't reproduce."""
    quantized = quantization_reason(
        model if not isinstance(model, (str, os.PathLike)) else hf_config
    )
    if quantized is not None:
        raise ValueError(f"{quantized[1]} [{quantized[0]}]")
    if not isinstance(model, (str, os.PathLike)):
        from hf_paged.models import peft

        reason = peft.unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"model=<PEFT model> is not allowed: {reason[1]} [{reason[0]}]; the engine "
                "serves plain LoRA (merged into its weights); use the PEFT model's own generate"
            )
