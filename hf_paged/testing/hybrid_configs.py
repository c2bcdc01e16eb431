"""Tiny configs of the hybrid and recurrent families, each with its own fields.

``any_model.shrink_config`` shrinks the common keys (hidden 64, 4 heads of 16, vocab 192) and
cuts per-layer lists to two layers; these families also need their own sizes to agree with
that (Mamba 2's ``num_heads * head_dim == expand * hidden``, Bamba's head state) and a layer
pattern that mixes their layer kinds. ``build_tiny`` applies ``HYBRID_TINY[model_type]`` on top.
"""

from __future__ import annotations

_L, _F = "linear_attention", "full_attention"

# Gated DeltaNet: 2 key heads, 4 value heads (grouped), heads of 16, conv kernel 4
_GDN = {
    "num_hidden_layers": 4,
    "layer_types": [_L, _L, _F, _L],
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
}
# Mamba 2 style (hidden 64, expand 2: 8 heads of 16), chunks of 16 so prompts cross them
_SSD = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_d_state": 16,
    "mamba_n_groups": 1,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}

HYBRID_TINY: dict[str, dict] = {
    "qwen3_5_text": dict(_GDN),
    "qwen3_5_moe_text": dict(_GDN),
    "qwen3_next": {**_GDN, "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "olmo_hybrid": {**_GDN, "linear_allow_neg_eigval": True},
    # lightning attention in blocks of 16 (prompts of up to 70 tokens cross several)
    "minimax": {"num_hidden_layers": 4, "layer_types": [_L, _F, _L, _L], "block_size": 16},
    "mamba": {"num_hidden_layers": 2, "state_size": 8, "expand": 2, "conv_kernel": 4,
              "time_step_rank": 8},
    "falcon_mamba": {"num_hidden_layers": 2, "state_size": 8, "expand": 2, "conv_kernel": 4,
                     "time_step_rank": 8},
    "mamba2": {"num_hidden_layers": 2, "num_heads": 8, "head_dim": 16, "state_size": 16,
               "n_groups": 2, "expand": 2, "conv_kernel": 4, "time_step_rank": 8,
               "chunk_size": 16},
    "falcon_h1": {**_SSD, "num_hidden_layers": 2, "mamba_d_ssm": 128},
    "bamba": {**_SSD, "num_hidden_layers": 3, "attn_layer_indices": [1]},
    "granitemoehybrid": {**_SSD, "num_hidden_layers": 3,
                         "layer_types": ["mamba", "attention", "mamba"]},
    "nemotron_h": {"layers_block_type": ["mamba", "attention", "mamba", "moe"],
                   "mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16,
                   "n_groups": 2, "expand": 2, "conv_kernel": 4, "chunk_size": 16,
                   "moe_shared_expert_intermediate_size": 32},
    "jamba": {"num_hidden_layers": 4, "attn_layer_period": 2, "attn_layer_offset": 1,
              "expert_layer_period": 2, "expert_layer_offset": 1, "mamba_d_state": 8,
              "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 8,
              },
    "lfm2": {"num_hidden_layers": 4, "layer_types": ["conv", _F, "conv", "conv"],
             "full_attn_idxs": [1], "conv_L_cache": 3},
    "recurrent_gemma": {"num_hidden_layers": 3, "block_types": ["recurrent", "attention",
                                                                "recurrent"],
                        "lru_width": 64, "attention_window_size": 32, "conv1d_width": 4},
}  # fmt: skip

# the 14 hybrid and recurrent families served, each mixing its layer kinds
HYBRID_FAMILIES = (
    "qwen3_5_text", "qwen3_next", "olmo_hybrid", "minimax", "mamba", "falcon_mamba", "mamba2",
    "falcon_h1", "bamba", "granitemoehybrid", "nemotron_h", "jamba", "lfm2", "recurrent_gemma",
)  # fmt: skip
# families beyond the list whose recurrent layers an existing mixer serves (LaraMini's
# Gated DeltaNet is Qwen3.5's, LFM3's short conv LFM2's); their default configs mix layer kinds
# when cut to two layers, so they need no fields of their own
MORE_HYBRID_FAMILIES = ("lara_mini", "lfm3")
