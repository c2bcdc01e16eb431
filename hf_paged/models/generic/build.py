"""Build an HF causal LM on the meta device with real buffers, for the generic path.

Parameters stay on meta until ``weights.py`` gives each one its tensor (shared with an in-memory
model, or read from the checkpoint), so building costs no memory and no random init. Buffers
are made real on the target device at once and filled the way ``from_pretrained`` fills them:
non-persistent ones (rotary ``inv_freq``...) by the model class's own ``_init_weights``.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from hf_paged.layers.quantization.fp8_config import fp8_config_of
from hf_paged.models.generic.adapters import install as install_adapters
from hf_paged.models.generic.attention import ATTN_IMPL, register
from hf_paged.models.generic.fp8 import install_fp8_linears
from hf_paged.models.generic.rope import install as install_deferred_rope
from hf_paged.models.generic.support import resolve_hf_class


def build_on_meta(hf_config, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The HF model for ``hf_config`` with ``attn_implementation`` = hf_paged's, parameters on
    meta, buffers real on ``device``. ``hf_config`` itself is not modified."""
    from hf_paged.models.registry import default_dtype

    register()
    cls = resolve_hf_class(hf_config)
    config = copy.deepcopy(hf_config)
    with torch.device("meta"), default_dtype(dtype):
        model = cls._from_config(config, attn_implementation=ATTN_IMPL, dtype=dtype)
    model.eval()
    install_fp8_linears(model, fp8_config_of(hf_config))  # FP8 checkpoints: float8 linears
    install_adapters(model)  # attention modules that do not call AttentionInterface
    install_deferred_rope(model)  # Llama's apply_rotary_pos_emb: the paged layer rotates q/k
    materialize_buffers(model, device)
    return model


def materialize_buffers(model: nn.Module, device: torch.device) -> None:
    """Give every meta buffer real storage on ``device``; re-run ``_init_weights`` on modules
    owning non-persistent ones (their values come from the config, not the checkpoint)."""
    owners = []
    for module in model.modules():
        touched = False
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device.type == "meta":
                module._buffers[name] = torch.zeros_like(buf, device=device)
                touched = touched or name in module._non_persistent_buffers_set
        if touched:
            owners.append(module)
    with torch.no_grad():
        for module in owners:
            model._init_weights(module)


def meta_tensor_attributes(model: nn.Module) -> list[str]:
    """Plain tensor attributes (not parameters or buffers) left on meta: the model computes
    them at init, so the generic path cannot rebuild them."""
    found = []
    for mod_name, module in model.named_modules():
        for attr, val in vars(module).items():
            if isinstance(val, torch.Tensor) and val.device.type == "meta":
                found.append(f"{mod_name}.{attr}" if mod_name else attr)
    return found


def backbone_of(model: nn.Module) -> nn.Module:
    """The decoder stack the causal LM's forward calls: ``get_decoder()`` (OPT's
    ``model.decoder``, Llama's ``model``, a vision-language model's ``language_model``...),
    else the base model."""
    from transformers import PreTrainedModel

    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    # a PreTrainedModel only: BERT-style heads name their output projection ``decoder``
    if isinstance(decoder, PreTrainedModel) and decoder is not model:
        # a vision-language model's decoder may be a causal LM itself (Llama 4): its stack
        inner = getattr(decoder, "model", None)
        if hasattr(decoder, "lm_head") and isinstance(inner, PreTrainedModel):
            return inner
        return decoder
    base = getattr(model, "base_model", None)
    if isinstance(base, nn.Module) and base is not model:
        return base
    inner = getattr(model, "model", None)  # Llama 4's base_model_prefix names another attribute
    if isinstance(inner, PreTrainedModel):
        return inner
    raise ValueError(f"{type(model).__name__} has no backbone module to call")
