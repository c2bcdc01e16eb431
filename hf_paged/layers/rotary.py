"""Rotary position embedding (GPT-NeoX "rotate half" layout), driven by the HF config.

Frequencies come from transformers' own ``ROPE_INIT_FUNCTIONS`` (linear, dynamic, yarn, longrope,
llama3, ...) so every scaling variant matches HF bit for bit; ``default`` is computed here exactly
as HF's ``compute_default_rope_parameters`` does. cos/sin are computed in float32 from the
positions at each forward (no position cache to size), scaled by ``attention_scaling``, then
cast to the activation dtype, as HF does.

Sequence-length dependent variants follow HF's ``dynamic_rope_update``:

* ``dynamic`` (NTK): when ``max(positions) + 1`` exceeds ``max_position_embeddings`` the
  frequencies are recomputed for that length, else the original ones are used.
* ``longrope``: the long factors are used when ``max(positions) + 1`` exceeds
  ``original_max_position_embeddings``, the short ones otherwise.

Like HF, the switch looks at the largest position in the whole batch. HF batches a fixed set of
padded rows, we batch whatever the scheduler put together (and chunk long prefills), so once any
sequence is past the original length, results for these two types would differ from stock's:
``length_dependent_limit`` names that length and the runtime caps ``max_model_len`` there (a
larger one is refused, ``generate`` runs stock). Both paths stay on the device
(``torch.where``), no host sync.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from hf_paged.kernels import fused_rope
from hf_paged.kernels.fused_rope import rotary_emb_ref

if TYPE_CHECKING:
    from hf_paged.layers.layernorm import RMSNorm


def rope_parameters(hf_config) -> dict:
    """The config's flat RoPE parameter dict (``rope_type``, ``rope_theta``, ...).

    Raises:
        ValueError: per-layer-type (nested) RoPE parameters, which these models do not use.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if params is None:  # pre-5.0 style config
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"per-layer rope_parameters are not supported: {params}")
    return params


def length_dependent_limit(hf_config) -> tuple[str, int] | None:
    """``(rope_type, length)`` when the config's rope frequencies change once a forward's
    longest sequence passes ``length`` (HF's ``dynamic_rope_update``: dynamic NTK past
    ``max_position_embeddings``, longrope past ``original_max_position_embeddings``), else None.

    Stock takes that length from its own padded batch at each forward; the engine batches,
    chunks and recomputes sequences differently, so it reproduces stock only while no sequence
    passes ``length`` (``engine.runtime`` caps ``max_model_len`` there)."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    nested = [v for v in params.values() if isinstance(v, dict)]  # per layer type
    limits = []
    for p in nested or [params]:
        kind = p.get("rope_type", p.get("type", "default"))
        if "dynamic" in kind:
            limits.append((kind, cfg.max_position_embeddings))
        elif kind == "longrope":
            orig = p.get("original_max_position_embeddings")
            orig = orig or getattr(cfg, "original_max_position_embeddings", None)
            limits.append((kind, orig or cfg.max_position_embeddings))
    return min(limits, key=lambda kl: kl[1]) if limits else None


def default_inv_freq(base: float, dim: int) -> torch.Tensor:
    # exactly HF's compute_default_rope_parameters
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


class RotaryEmbedding(nn.Module):
    """Computes ``(cos, sin)`` [T, head_dim] for positions [T]; apply with ``apply_rotary_emb``.

    ``inv_freq`` is a float32 buffer: build the model under the target dtype (see
    ``build_model``) rather than calling ``.to(dtype)`` on it, which would round it.

    Args:
        hf_config: the HF model config.
        head_dim: per-head size; the rotary dim must equal it (partial rotary is not supported).

    Raises:
        ValueError: unknown rope_type, nested per-layer parameters, or partial rotary.
    """

    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = rope_parameters(hf_config)
        self.rope_type = params.get("rope_type", params.get("type", "default"))
        if self.rope_type == "default":
            inv_freq, scaling = default_inv_freq(params["rope_theta"], head_dim), 1.0
        elif self.rope_type in ROPE_INIT_FUNCTIONS:
            self._init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
            inv_freq, scaling = self._init_fn(hf_config, None)
        else:
            raise ValueError(
                f"rope_type={self.rope_type!r} is not supported: must be 'default' or one of "
                f"{sorted(ROPE_INIT_FUNCTIONS)}"
            )
        if inv_freq.numel() * 2 != head_dim:
            raise ValueError(
                f"rotary dim {inv_freq.numel() * 2} != head_dim {head_dim}: partial rotary "
                "embeddings are not supported"
            )
        self.hf_config = hf_config
        self.head_dim = head_dim
        self.attention_scaling = float(scaling)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.is_dynamic = "dynamic" in self.rope_type or self.rope_type == "longrope"
        if self.rope_type == "longrope":
            self.switch_len = params["original_max_position_embeddings"]
            long_inv_freq, _ = self._init_fn(hf_config, None, seq_len=self.switch_len + 1)
            self.register_buffer("long_inv_freq", long_inv_freq.float(), persistent=False)
        elif self.is_dynamic:
            self.switch_len = hf_config.max_position_embeddings

    def _inv_freq_for(self, positions: torch.Tensor) -> torch.Tensor:
        if not self.is_dynamic:
            return self.inv_freq
        seq_len = positions.max() + 1  # 0-dim tensor, stays on the device
        if self.rope_type == "longrope":
            long = self.long_inv_freq
        else:  # HF recomputes with the tensor seq_len when the batch grows past the limit
            long, _ = self._init_fn(self.hf_config, positions.device, seq_len=seq_len)
        return torch.where(seq_len > self.switch_len, long.float(), self.inv_freq)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin), each [T, head_dim] in ``dtype``."""
        inv_freq = self._inv_freq_for(positions)
        freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        return f"rope_type={self.rope_type}, head_dim={self.head_dim}"


def apply_rotary_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] by ``cos``/``sin`` [T, D] (same ops as HF's apply_rotary_pos_emb)."""
    return rotary_emb_ref(x, cos, sin)


def apply_rotary_emb_qk(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,
    q_norm: RMSNorm | None = None,
    k_norm: RMSNorm | None = None,
    kv_cache: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """``q_norm``/``k_norm`` per head (Qwen3; both or neither), then rotary, on q and k.

    On CUDA (with triton) one Triton launch (``hf_paged.kernels.fused_rope``); elsewhere, or for
    inputs the kernel does not take, the modules and :func:`apply_rotary_emb`, as HF does.
    ``kv_cache = (v, k_cache, v_cache, slot_mapping)`` (see ``layers.attention.Attention``) asks
    the kernel to also write the rotated k and v into the paged cache.

    Returns:
        ``(q, k, stored)``: ``stored`` says whether the cache write was done here (the
        attention backend must then skip its own).
    """
    if q_norm is None:
        q_w, k_w, eps, same_eps = None, None, 0.0, True
    else:
        q_w, k_w, eps, same_eps = q_norm.weight, k_norm.weight, q_norm.eps, q_norm.eps == k_norm.eps
    if same_eps and fused_rope.supports(q, k, cos, sin, q_w, k_w):
        if kv_cache is not None and fused_rope.kv_cache_problem(k, *kv_cache) is not None:
            kv_cache = None
        q, k = fused_rope.launch_checked(q, k, cos, sin, q_w, k_w, eps, kv_cache)
        return q, k, kv_cache is not None
    if q_norm is not None:
        q, k = q_norm(q), k_norm(k)
    return apply_rotary_emb(q, cos, sin), apply_rotary_emb(k, cos, sin), False
