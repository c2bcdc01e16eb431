"""A tiny random model of any architecture in transformers: its default config shrunk (hidden 64,
2 layers, 4 heads, vocab 192, small MoE and MLA sizes), as the coverage tests build them."""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.testing.hybrid_configs import HYBRID_TINY
from hf_paged.testing.models import randomize_

VOCAB = 192
HIDDEN = 64

# shrunk sizes, set on any config that has the key (attribute_map aliases resolve)
_SMALL = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "head_dim": 16,
    "sliding_window": 8,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "moe_num_experts": 4,
    "moe_k": 2,
    "moe_topk": 2,
    # MLA
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 16,
    "qk_head_dim": 24,
    "v_head_dim": 16,
    # misc widths
    "n_inner": 128,
    "ffn_hidden_size": 128,
    "rotary_dim": 8,
    "partial_rotary_factor": 0.5,
    "global_attn_every_n_layers": 2,
    "embedding_size": HIDDEN,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "is_decoder": True,  # BERT-style LM heads are causal only as decoders
}
# keys whose None default means "off" (no window, no low-rank q, full rotary...): kept None
_KEEP_NONE = {"sliding_window", "q_lora_rank", "rotary_dim", "partial_rotary_factor"}
# per model_type extra overrides (applied after _SMALL)
_EXTRA: dict[str, dict] = {
    "xmod": {"default_language": "en_XX"},
    "zaya": {"num_experts_per_tok": 1},
    # DbrxAttention reads attn_config.rope_theta and clamps by clip_qkv, which real DBRX configs
    # set (500000, 8) and the default DbrxAttentionConfig lacks; ffn_config.hidden_size follows
    # d_model as it is at init
    "dbrx": {
        "d_model": HIDDEN,
        "attn_config": {"rope_theta": 10000.0, "kv_n_heads": 2, "clip_qkv": 8.0},
        "ffn_config": {"ffn_hidden_size": 128, "moe_num_experts": 4, "moe_top_k": 2},
    },
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gemma4_unified_assistant": {"hidden_size_per_layer_input": 0},
}


def _layer_list(value, n: int):
    """A per-layer list cut to ``n`` entries, keeping every distinct value it has."""
    distinct = list(dict.fromkeys(value))
    if len(distinct) >= n:
        return distinct[:n]
    return (distinct * n)[:n]


def _shrink_per_layer(d: dict, layer_types) -> dict:
    """Gemma4-style ``per_layer_config`` ({"05": {...}}): the first entry moved to a kept layer
    of the same type, its sizes shrunk (head dims to twice the shrunk head_dim)."""
    key, entry = next(iter(d["per_layer_config"].items()))
    kind = layer_types[int(key)] if layer_types else None
    kept = d.get("layer_types") or []
    idx = kept.index(kind) if kind in kept else len(kept) - 1
    small = {k: (2 * _SMALL["head_dim"] if "head_dim" in k else _SMALL.get(k, v))
             for k, v in entry.items()}  # fmt: skip
    return {f"{max(idx, 0):02d}": small}


def shrink_config(config):
    """A tiny copy of ``config`` (see ``_SMALL``); per-layer lists cut to two layers; a hybrid or
    recurrent family then gets its own fields (``hybrid_configs.HYBRID_TINY``)."""
    d = config.to_dict()
    n_orig = getattr(config, "num_hidden_layers", None)
    keys = set(d) | set(getattr(config, "attribute_map", {}))
    for k, v in {**_SMALL, **_EXTRA.get(config.model_type, {})}.items():
        if k in keys and not (k in _KEEP_NONE and d.get(k, 0) is None):
            d[k] = v
    heads, kv = (
        getattr(config, "num_attention_heads", None),
        getattr(config, "num_key_value_heads", None),
    )
    if "num_key_value_heads" in keys:  # keep MHA / MQA / GQA as it was
        d["num_key_value_heads"] = 4 if kv in (heads, None) else 1 if kv == 1 else 2
    if "qk_rope_head_dim" in keys:  # MLA: head_dim is the rotary part
        d["head_dim"] = d["qk_rope_head_dim"]
    if "text_config" in d and isinstance(d["text_config"], dict):
        d["text_config"] = shrink_config(config.text_config).to_dict()
    for k, v in list(d.items()):
        if isinstance(v, list) and n_orig and len(v) == n_orig and n_orig > 2:
            d[k] = _layer_list(v, 2)
    if isinstance(d.get("per_layer_config"), dict) and d["per_layer_config"]:
        d["per_layer_config"] = _shrink_per_layer(d, getattr(config, "layer_types", None))
    d.update(HYBRID_TINY.get(config.model_type, {}))  # the family's own fields, as a whole
    d.pop("transformers_version", None)
    d.pop("architectures", None)
    return type(config)(**{k: v for k, v in d.items() if k != "model_type"})


def build_tiny(model_type: str, seed: int = 0, norms_near_one: bool = False, **overrides):
    """A tiny random fp32 causal LM of ``model_type`` in eval mode, and its config.

    Args:
        model_type: a key of transformers' ``CONFIG_MAPPING``.
        seed: seeds the init and ``randomize_``.
        norms_near_one: also redraw every ``nn.LayerNorm`` weight near 1: ``randomize_`` leaves
            BERT-style ``LayerNorm`` (not named ``*norm*``) at 0.15 scale, where greedy tokens
            collapse onto one id.
        **overrides: config keys set on the shrunk config (they win over ``shrink_config``).

    Returns:
        ``(config, model)``.
    """
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    config = shrink_config(CONFIG_MAPPING[model_type]())
    if overrides:
        d = {**config.to_dict(), **overrides}
        config = type(config)(**{k: v for k, v in d.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = randomize_(AutoModelForCausalLM.from_config(config, dtype=torch.float32), seed)
    if norms_near_one:
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.LayerNorm) and m.weight is not None:
                    m.weight.copy_(1.0 + 0.2 * torch.randn(m.weight.shape, generator=g))
    return config, model.eval()
