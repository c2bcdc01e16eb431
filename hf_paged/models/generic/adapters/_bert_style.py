"""What the BERT-style self-attention adapters share (RoFormer, MegatronBERT, RemBERT, BigBird):
modules with ``query`` / ``key`` / ``value`` ``nn.Linear`` projections of ``attention_head_size``
heads whose forward returns ``(context [B, T, H * D], attention_probs)``, and the checks that
make them causal decoders that the paged attention reproduces.

These models are causal LMs only when ``config.is_decoder`` is set and the base model builds a
causal mask for decoders; some transformers versions build a bidirectional one there (their
causal LM then attends to later prompt tokens), which the paged attention cannot reproduce.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from hf_paged.models.generic.attention import paged_attention_forward
from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.refusal import Refusal


@functools.cache
def bidirectional_refusal(base_model_cls: type) -> Refusal | None:
    """Why ``base_model_cls`` (the base model of a BERT-style causal LM) is not causal on the
    installed transformers (reason "architecture"), or None: its forward must build its mask
    with ``create_causal_mask`` for decoders."""
    try:
        source = inspect.getsource(base_model_cls.forward)
    except (OSError, TypeError):
        return Refusal(
            "architecture", f"{base_model_cls.__name__}'s forward cannot be read to check its mask"
        )
    if "create_causal_mask" in source:
        return None
    import transformers

    return Refusal(
        "architecture",
        f"{base_model_cls.__name__} builds a bidirectional attention mask for decoders on "
        f"transformers {transformers.__version__} (its causal LM attends to later prompt "
        "tokens); the paged attention is causal",
    )


def check_causal_self_attention(
    module: nn.Module, encoder_hidden_states, reason: Refusal | None, is_decoder: bool | None = None
) -> None:
    """Raise ``UnsupportedModelError`` unless ``module`` runs as causal self-attention
    (``is_decoder`` defaults to the module's own ``is_decoder``)."""
    name = type(module).__name__
    if reason is not None:
        raise UnsupportedModelError(reason.detail)
    if is_decoder is None:
        is_decoder = getattr(module, "is_decoder", False)
    if not is_decoder:
        raise UnsupportedModelError(
            f"{name} has config.is_decoder=False: the causal LM attends bidirectionally "
            "(set is_decoder=True for causal generation)"
        )
    if encoder_hidden_states is not None:
        raise UnsupportedModelError(f"{name}: cross-attention to encoder states")


def project_heads(module: nn.Module, hidden_states: torch.Tensor):
    """``hidden_states [1, T, hidden]`` -> query, key, value ``[1, H, T, D]`` through the
    module's own ``query`` / ``key`` / ``value`` projections (-1 heads: TP shards them)."""
    shape = (*hidden_states.shape[:-1], -1, module.attention_head_size)  # [1, T, H, D]
    q = module.query(hidden_states).view(shape).transpose(1, 2)
    k = module.key(hidden_states).view(shape).transpose(1, 2)
    v = module.value(hidden_states).view(shape).transpose(1, 2)
    return q, k, v


def attend(module: nn.Module, query, key, value) -> tuple[torch.Tensor, None]:
    """Paged causal attention at the modules' scale ``1 / sqrt(D)``; returns what the HF forward
    returns: ``(context [1, T, H * D], None)`` (no attention probabilities). ``module`` is the
    one the profile pass binds a KV layer to."""
    scale = query.shape[-1] ** -0.5
    out, _ = paged_attention_forward(module, query, key, value, None, scaling=scale)  # [1, T, H, D]
    return out.reshape(*out.shape[:2], -1), None


def serve_bert_self_attention(causal_lm: type, base_model: type, self_attention: type) -> None:
    """Register the plain BERT self-attention adapter for one family (MegatronBERT, RemBERT):
    ``self_attention``'s projections, paged causal attention, ``(context, None)``."""
    from hf_paged.models.generic.adapters import register

    def forward(
        module: nn.Module,
        hidden_states: torch.Tensor,  # [1, T, hidden]
        attention_mask=None,
        encoder_hidden_states=None,
        *args,
        **kwargs,
    ) -> tuple[torch.Tensor, None]:
        reason = bidirectional_refusal(base_model)
        check_causal_self_attention(module, encoder_hidden_states, reason)
        return attend(module, *project_heads(module, hidden_states))

    register(model_classes=(causal_lm,), adapters={self_attention: forward})
