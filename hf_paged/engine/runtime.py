"""Values derived at start-up (device, dtype, lengths, EOS ids, KV block count). They live here,
never written back into the frozen EngineConfig."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from hf_paged.config import EngineConfig
from hf_paged.models.registry import resolve_model_class
from hf_paged.paths import not_a_checkpoint

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class RuntimeInfo:
    hf_config: object
    tokenizer: object | None
    device: str  # "cpu" or "cuda:N" (rank 0)
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    model_path: str | None  # checkpoint directory, or None for an in-memory model
    config: EngineConfig
    num_kv_blocks: int = 0  # set once the runner has sized the cache


def _as_ids(x) -> tuple[int, ...]:
    if x is None:
        return ()
    if isinstance(x, int):
        return (x,)
    return tuple(int(i) for i in x)


def _resolve_device(requested: str | None, model_device: torch.device | None) -> str:
    if requested is None:
        if model_device is not None:
            requested = str(model_device)
        else:
            requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device={requested!r} is not allowed: CUDA is not available here")
        if requested == "cuda":
            requested = f"cuda:{torch.cuda.current_device()}"
    return requested


def _resolve_dtype(name: str, checkpoint_dtype, device: str) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype, torch.float32)
    dtype = checkpoint_dtype if isinstance(checkpoint_dtype, torch.dtype) else torch.float32
    if device == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 matmuls are slow or missing on CPU
    return dtype


def _load_tokenizer(path: str):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def quantization_method(model_or_config) -> str | None:
    """The ``quant_method`` of a quantized model or config ("bitsandbytes", "gptq", "awq",
    "fp8" ...; "unknown" when it names none), or None for plain weights. The engine implements
    no quantized weights, so any method is one it can't serve."""
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
    run (today: any), else None. The one place that decides, and says so in words."""
    method = quantization_method(model_or_config)
    if method is None:
        return None
    return f"quantized_{method}", (
        f"quantization_config with quant_method={method!r} is not allowed: the engine runs only "
        "unquantized float weights (float32/float16/bfloat16); load an unquantized checkpoint, "
        "or use transformers' own generate for this one"
    )


def _check_servable(model, hf_config) -> None:
    """ValueError for what the engine can't run and ``LLM`` has no stock model to fall back
    on for: quantized weights, and PEFT adapters that merged weights can't reproduce."""
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


def default_max_model_len(hf_config) -> int:
    """``max_model_len`` when the config sets none: the model's own positions (2048 if unknown)."""
    return getattr(hf_config, "max_position_embeddings", None) or 2048


def resolve_runtime(model, config: EngineConfig) -> RuntimeInfo:
    """Read the model's config, pick device/dtype/lengths. ``model`` is a checkpoint directory,
    an in-memory HF causal-LM, or a ``PeftModel`` around one.

    Raises:
        ValueError: a quantized model or checkpoint (naming its quant_method), PEFT adapters the
            engine can't reproduce, an unsupported architecture, a bad path or device.
    """
    from transformers import AutoConfig, GenerationConfig, PreTrainedModel

    from hf_paged.models.peft import is_peft_model, unwrap

    if is_peft_model(model):
        _check_servable(model, None)
        model = unwrap(model)
    if isinstance(model, PreTrainedModel):
        hf_config = model.config
        gen_config = getattr(model, "generation_config", None)
        device = _resolve_device(config.device, model.device)
        dtype = _resolve_dtype(config.dtype, model.dtype, device)
        path, tokenizer = None, None
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise ValueError(not_a_checkpoint(
                "model", path, "a local checkpoint directory or a loaded transformers model"
            ))
        hf_config = AutoConfig.from_pretrained(path)
        try:
            gen_config = GenerationConfig.from_pretrained(path)
        except OSError:
            gen_config = None
        device = _resolve_device(config.device, None)
        ckpt_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        dtype = _resolve_dtype(config.dtype, ckpt_dtype, device)
        tokenizer = _load_tokenizer(path)
    else:
        raise TypeError(
            f"model={type(model).__name__} is not allowed: pass a checkpoint directory or a "
            "transformers PreTrainedModel"
        )
    _check_servable(model, hf_config)
    resolve_model_class(hf_config, config.model_impl)  # raises, naming why, if no path runs it
    max_model_len = config.max_model_len or default_max_model_len(hf_config)
    eos = _as_ids(getattr(gen_config, "eos_token_id", None)) or _as_ids(
        getattr(hf_config, "eos_token_id", None)
    )
    return RuntimeInfo(
        hf_config=hf_config,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        vocab_size=hf_config.vocab_size,
        eos_token_ids=eos,
        model_path=path,
        config=config,
    )
