"""Values derived at start-up (device, dtype, lengths, EOS ids, KV block count). They live here,
never written back into the frozen EngineConfig."""

from __future__ import annotations

import copy
import os
import sys
from dataclasses import dataclass

import torch

from hf_paged.config import EngineConfig
from hf_paged.layers.rotary import length_dependent_limit
from hf_paged.models.forward_wrappers import instance_autocast
from hf_paged.models.generic.support import checkpoint_class_refusal
from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.models.registry import resolve_model_class
from hf_paged.models.servable import check_servable
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
    # recurrent layers: state-pool slots (one per sequence that can run; 0: no such layers) and
    # the bytes of one slot over all layers, set once the runner has reserved them
    num_state_slots: int = 0
    state_slot_bytes: int = 0
    # prefix caching as the engine runs it: the config's, but off for a model with recurrent
    # layers (a cached KV prefix has no state snapshot to start from); the config stays as given
    enable_prefix_caching: bool = True
    # the engine's image features by content hash (``core/encoder_cache.py``): the front ends
    # that encode a vision-language model's images for this engine share it; set by LLMEngine
    encoder_cache: object | None = None
    lora: object | None = None  # ``LoraSpec`` when the engine builds LoRA slots, else None
    # the autocast the in-memory model's forward runs under (accelerate's bf16 mixed precision),
    # under which every rank runs the engine's forward; None: the weights' dtype
    # (``models/autocast.py``)
    autocast: object | None = None

    @property
    def mrope(self) -> bool:
        """The decoder's rotary takes ``[3, T]`` positions (Qwen's M-RoPE)."""
        return takes_mrope(self.hf_config)


def takes_mrope(hf_config) -> bool:
    """A config's decoder rotates by ``[3, T]`` positions (Qwen2/2.5/3/3.5-VL): its rope
    parameters name M-RoPE sections, or its vision-language class computes them with stock's
    ``get_rope_index`` (whose rotary falls back to default sections when the config has none)."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    for name in ("rope_parameters", "rope_scaling"):
        rope = getattr(text, name, None)
        if isinstance(rope, dict) and rope.get("mrope_section"):
            return True
    from hf_paged.models.generic.support import image_text_class

    cls = image_text_class(hf_config)
    module = sys.modules.get(cls.__module__) if cls is not None else None
    return module is not None and any(
        isinstance(v, type) and callable(getattr(v, "get_rope_index", None))
        for v in vars(module).values()
    )


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


def _served_config(model):
    """The config the engine builds an in-memory model from: its own, without the
    ``quantization_config`` when its weights are plain (dequantized by transformers at load,
    or a config that names FP8 over plain weights)."""
    from hf_paged.layers.quantization import fp8_config_of
    from hf_paged.layers.quantization.fp8_config import (
        UnsupportedQuantizationError,
        with_plain_modules,
    )

    config = model.config
    if getattr(config, "quantization_config", None) is None:
        return config
    try:
        if fp8_config_of(model) is not None:
            return with_plain_modules(model)  # FP8Linear modules left plain stay plain
    except UnsupportedQuantizationError:
        return config  # refused by check_servable, naming why
    plain = copy.deepcopy(config)
    del plain.quantization_config
    return plain


def _compute_dtype(model) -> torch.dtype:
    """The model's activation dtype: that of its first parameter that is neither float8 nor an
    FP8 scale (``model.dtype`` may name a float8 weight)."""
    for name, p in model.named_parameters():
        if p.is_floating_point() and p.element_size() > 1 and "scale" not in name.split(".")[-1]:
            return p.dtype
    return model.dtype


def default_max_model_len(hf_config) -> int:
    """``max_model_len`` when the config sets none: the model's own positions (2048 if unknown),
    or less where its rope changes with the length (``rope_length_limit``)."""
    own = getattr(hf_config, "max_position_embeddings", None) or 2048
    limit = length_dependent_limit(hf_config)
    return own if limit is None else min(own, limit[1])


def rope_length_limit(hf_config, max_model_len: int) -> str | None:
    """Why ``max_model_len`` is too long for this model's rope, or None: HF's dynamic NTK and
    longrope frequencies follow the longest sequence of each forward, which the engine's
    batches and chunks do not reproduce past that length."""
    limit = length_dependent_limit(hf_config)
    if limit is None or max_model_len <= limit[1]:
        return None
    kind, length = limit
    return (
        f"max_model_len={max_model_len} is not allowed for this model: its rope_type {kind!r} "
        f"changes frequencies once a forward's longest sequence passes {length} tokens, and "
        "stock takes that length from its own padded batch, which the engine's batches and "
        f"chunked prefills do not reproduce; max_model_len must be <= {length}"
    )


def resolve_runtime(model, config: EngineConfig) -> RuntimeInfo:
    """Read the model's config, pick device/dtype/lengths. ``model`` is a checkpoint directory,
    an in-memory HF causal-LM, or a ``PeftModel`` around one.

    Raises:
        ValueError: a quantized model or checkpoint (naming its quant_method), PEFT adapters the
            engine can't reproduce, an unsupported architecture, a bad path or device.
    """
    from transformers import AutoConfig, GenerationConfig, PreTrainedModel

    from hf_paged.models.adapters import lora_spec
    from hf_paged.models.peft import is_peft_model, unwrap

    lora = lora_spec(model, config)  # before unwrapping: a PeftModel's adapters decide it
    autocast = None
    if is_peft_model(model):
        check_servable(model, None)
        model = unwrap(model)
    if isinstance(model, PreTrainedModel):
        hf_config = _served_config(model)
        autocast = instance_autocast(model)  # generate calls the HF model's forward, not PEFT's
        gen_config = getattr(model, "generation_config", None)
        device = _resolve_device(config.device, model.device)
        if autocast is not None and not device.startswith(autocast.device_type):
            raise ValueError(
                f"device={device!r} is not allowed for this model: its forward runs under "
                f"{autocast.describe()}, which the engine reproduces on that device only; "
                f"leave device unset (the model's) or set device={autocast.device_type!r}"
            )
        dtype = _resolve_dtype(config.dtype, _compute_dtype(model), device)
        path, tokenizer = None, None
    elif isinstance(model, (str, os.PathLike)):
        path = os.fspath(model)
        if not os.path.isdir(path):
            raise ValueError(
                not_a_checkpoint(
                    "model", path, "a local checkpoint directory or a loaded transformers model"
                )
            )
        hf_config = AutoConfig.from_pretrained(path)
        not_causal = checkpoint_class_refusal(hf_config)
        if not_causal is not None:
            raise UnsupportedModelError(not_causal.detail)
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
    check_servable(model, hf_config)
    resolve_model_class(hf_config, config.model_impl)  # raises, naming why, if no path runs it
    max_model_len = config.max_model_len or default_max_model_len(hf_config)
    too_long = rope_length_limit(hf_config, max_model_len)
    if too_long is not None:
        raise ValueError(too_long)
    eos = _as_ids(getattr(gen_config, "eos_token_id", None)) or _as_ids(
        getattr(hf_config, "eos_token_id", None)
    )
    return RuntimeInfo(
        hf_config=hf_config,
        tokenizer=tokenizer,
        device=device,
        dtype=dtype,
        max_model_len=max_model_len,
        vocab_size=_text_config(hf_config).vocab_size,
        eos_token_ids=eos,
        model_path=path,
        config=config,
        lora=lora,
        autocast=autocast,
    )


def _text_config(hf_config):
    """The decoder's config: a vision-language model's ``text_config``, else the config."""
    return hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
