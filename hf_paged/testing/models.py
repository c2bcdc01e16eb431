"""Tiny random HF models of the native families (hidden 64, 2 layers), in memory or saved
through safetensors, with a tokenizer that decodes every id they emit."""

from __future__ import annotations

import os

import torch
from torch import nn

from hf_paged.testing.tokenizer import build_char_tokenizer

FAMILIES = ("llama", "llama3_rope", "mistral", "qwen2", "qwen3")

TINY_VOCAB = 256  # tiny_config's vocabulary: pad 0, bos 1, eos 2

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)

# family -> (config class name, architecture, family-specific defaults)
_FAMILY = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3_rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            # original_max_position_embeddings small enough that every frequency band
            # (scaled, smoothed, untouched) occurs at head_dim 16
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    # explicit head_dim different from hidden / heads, tied embeddings like Qwen3-0.6B
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32, "tie_word_embeddings": True}),
}


def tiny_config(family: str, **overrides):
    """A tiny HF config (hidden 64, 2 layers, 4 heads, 2 kv heads, vocab 256) for ``family``.

    Args:
        family: one of ``FAMILIES``.
        **overrides: config keys to set or replace (e.g. ``num_key_value_heads=1``).

    Raises:
        ValueError: unknown family.
    """
    import transformers

    if family not in _FAMILY:
        raise ValueError(f"family={family!r} is not allowed: must be one of {FAMILIES}")
    cls_name, arch, extra = _FAMILY[family]
    kwargs = {**_COMMON, **extra, **overrides}
    if "rope_parameters" in kwargs:  # the config may edit it in place: give it its own copy
        kwargs["rope_parameters"] = dict(kwargs["rope_parameters"])
    config = getattr(transformers, cls_name)(**kwargs)
    config.architectures = [arch]
    return config


def randomize_(model: nn.Module, seed: int = 0) -> nn.Module:
    """Re-draw every weight at a scale where attention is far from uniform and logits spread.

    HF's default init (std 0.02) makes attention nearly uniform, so a wrong mask or rope would
    barely move the logits; these scales make the parity tests sensitive to such bugs.
    """
    g = torch.Generator().manual_seed(seed)
    # a frozen embedding is a table the model computes at init (RoFormer's sinusoid): kept
    computed = {id(m.weight) for m in model.modules()
                if isinstance(m, nn.Embedding) and not m.weight.requires_grad}  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if id(p) in computed:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def build_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random fp32 HF causal LM of ``family`` (eval mode, sdpa attention)."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return randomize_(model, seed).eval()


def save_tiny_model(family: str, path: str | os.PathLike, seed: int = 0, **overrides):
    """Save a tiny random HF model of ``family`` (safetensors) to ``path``; returns ``path``."""
    os.makedirs(path, exist_ok=True)
    build_hf_model(family, seed, **overrides).save_pretrained(path)
    return path


def tiny_tokenizer():
    """The char tokenizer padded to ``TINY_VOCAB`` ids, so every id a tiny model emits decodes."""
    return build_char_tokenizer(TINY_VOCAB)


def save_checkpoint(path: str | os.PathLike, family: str = "llama", seed: int = 0) -> str:
    """A tiny random checkpoint of ``family`` plus ``tiny_tokenizer()`` in ``path``, as a user's
    model directory would be (llama seed 0 emits varied tokens); returns ``path``."""
    save_tiny_model(family, path, seed=seed)
    tiny_tokenizer().save_pretrained(path)
    return path


def save_demo_model(path: str, seed: int = 0, family: str = "qwen3") -> str:
    """Save a tiny random model (hidden 64, 2 layers) and the char tokenizer to ``path``; the
    model's vocabulary is the tokenizer's (99 ids), so every generated id decodes."""
    tok = build_char_tokenizer()
    save_tiny_model(family, path, seed=seed, vocab_size=len(tok))
    tok.save_pretrained(path)
    return path


def randomize_lora_(model, seed: int, adapter: str | None = None, scale: float = 0.3,
                    modules_to_save: bool = False):  # fmt: skip
    """Draw a PEFT model's LoRA factors (``adapter``'s, or every adapter's) from ``scale``
    N(0, 1), seeded by ``seed``, in parameter order, so that the adapter changes the tokens (PEFT
    starts B at zero); with ``modules_to_save`` also the adapter's full-module copies. Returns
    ``model``."""
    g = torch.Generator().manual_seed(seed)
    kinds = ("lora_", "modules_to_save") if modules_to_save else ("lora_",)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in kinds) and (adapter is None or f".{adapter}." in name):
                p.copy_(scale * torch.randn(p.shape, generator=g))
    return model


def save_random_lora(base_dir: str | os.PathLike, out: str | os.PathLike, seed: int,
                     scale: float = 0.3, **lora_config) -> str:  # fmt: skip
    """A PEFT LoRA adapter (``LoraConfig(**lora_config)``) over the model in ``base_dir``, its
    factors drawn by ``randomize_lora_`` (``seed``, ``scale``), saved to ``out``; returns
    ``out``."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir), LoraConfig(**lora_config)
    )
    randomize_lora_(model, seed, scale=scale).save_pretrained(out)
    return str(out)
