"""One decoder for the Llama family: Llama, Mistral, Qwen2 and Qwen3 differ only in config facts.

| family  | q/k/v bias         | o bias         | mlp bias   | q/k norm | sliding window              |
|---------|--------------------|----------------|------------|----------|-----------------------------|
| Llama   | attention_bias     | attention_bias | mlp_bias   | no       | never                       |
| Mistral | no                 | no             | no         | no       | every layer, if set         |
| Qwen2   | yes                | no             | no         | no       | layers typed "sliding_..."  |
| Qwen3   | attention_bias     | attention_bias | no         | yes      | layers typed "sliding_..."  |

(That is what transformers' modeling files do: Mistral ignores ``layer_types``; Qwen2/Qwen3
configs derive ``layer_types`` from ``use_sliding_window``/``max_window_layers`` and null
``sliding_window`` unless ``use_sliding_window``.)

Module and parameter names mirror HF checkpoints except the fused projections, which
``packed_modules_mapping`` maps back: ``q_proj/k_proj/v_proj -> qkv_proj`` (shards "q"/"k"/"v")
and ``gate_proj/up_proj -> gate_up_proj`` (shards 0/1).

Parameters are allocated with ``torch.empty`` in the current default dtype and device, so building
is cheap and the caller picks both (``hf_paged.models.registry.build_model`` scopes them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.kv_cache import KVCacheSpec
from hf_paged.layers.activation import SiluAndMul
from hf_paged.layers.attention import Attention, RopeInputs
from hf_paged.layers.context import ModelContext
from hf_paged.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from hf_paged.layers.layernorm import RMSNorm
from hf_paged.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from hf_paged.layers.quantization.fp8_config import (
    UnsupportedQuantizationError,
    fp8_config_of,
    layer_quant,
)
from hf_paged.layers.quantization.fp8_linear import input_group
from hf_paged.layers.rotary import RotaryEmbedding
from hf_paged.models import loader
from hf_paged.refusal import Refusal


@dataclass(frozen=True)
class DecoderOptions:
    """The per-family switches read from the HF config (see the module table)."""

    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k, before rope
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    quant: object = None  # the checkpoint's Fp8Config, or None for plain weights


def head_dim_of(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def fp8_layout_refusal(hf_config) -> Refusal | None:
    """Why the fused native layers cannot hold this FP8 checkpoint on one rank, or None: an FP8
    output head (ours is plain), fused modules partly FP8, or a block scale spanning two fused
    shards (a shard before the last not a multiple of ``weight_block_size[0]`` rows). HF's
    unfused modules hold all of these: the generic path serves them."""
    try:
        quant = fp8_config_of(hf_config)
    except UnsupportedQuantizationError:
        return None  # not served at all: the quantization check names why
    if quant is None:
        return None
    tied = getattr(hf_config, "tie_word_embeddings", False)  # a tied head is plain (stock too)
    if quant.converts("lm_head") and not tied:
        return Refusal(
            "fp8_layout",
            "the checkpoint's output head lm_head is FP8; the native output head is plain",
        )
    head_dim, kv = head_dim_of(hf_config), hf_config.num_key_value_heads
    inter = hf_config.intermediate_size
    fused = {
        "self_attn": (("q_proj", "k_proj", "v_proj"),
                      (hf_config.num_attention_heads * head_dim, kv * head_dim, kv * head_dim)),
        "mlp": (("gate_proj", "up_proj"), (inter, inter)),
    }  # fmt: skip
    for i in range(hf_config.num_hidden_layers):
        for module, (names, rows) in fused.items():
            full = [f"model.layers.{i}.{module}.{n}" for n in names]
            try:
                layer = layer_quant(quant, full)
            except UnsupportedQuantizationError as e:
                return Refusal("fp8_layout", str(e))
            if layer is not None and layer.block is not None:
                bn = layer.block[0]
                if any(r % bn for r in rows[:-1]):
                    return Refusal(
                        "fp8_layout",
                        f"the fused modules {list(names)} have {list(rows)} rows: a shard before "
                        f"the last is not a multiple of weight_block_size[0]={bn}, so one FP8 "
                        "scale block would span two of them",
                    )
    return None


def windows_from_layer_types(hf_config) -> tuple[int | None, ...]:
    """Qwen2/Qwen3: ``sliding_window`` on layers typed "sliding_attention", as HF does."""
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None) or ["full_attention"] * n
    window = getattr(hf_config, "sliding_window", None)
    return tuple(window if t == "sliding_attention" else None for t in types[:n])


class LlamaAttention(nn.Module):
    def __init__(self, hf_config, opts: DecoderOptions, layer_idx: int, ctx: ModelContext):
        super().__init__()
        head_dim = head_dim_of(hf_config)
        prefix = f"model.layers.{layer_idx}.self_attn."
        qkv = [prefix + n for n in ("q_proj", "k_proj", "v_proj")]
        self.qkv_proj = QKVParallelLinear(
            hf_config.hidden_size,
            head_dim,
            hf_config.num_attention_heads,
            hf_config.num_key_value_heads,
            bias=opts.qkv_bias,
            comm=ctx.comm,
            quant=layer_quant(opts.quant, qkv),
        )
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * head_dim,
            hf_config.hidden_size,
            bias=opts.o_bias,
            comm=ctx.comm,
            quant=layer_quant(opts.quant, [prefix + "o_proj"]),
        )
        if opts.qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=hf_config.rms_norm_eps)
            self.k_norm = RMSNorm(head_dim, eps=hf_config.rms_norm_eps)
        self.qk_norm = opts.qk_norm
        self.num_heads = self.qkv_proj.num_heads  # on this rank
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        spec = AttentionLayerSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=head_dim,
            scale=head_dim**-0.5,
            sliding_window=opts.sliding_windows[layer_idx],
        )
        self.attn = Attention(spec, ctx, layer_idx)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, hidden]
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q, k, v = self.qkv_proj(hidden).split([q_size, kv_size, kv_size], dim=-1)
        rope = RopeInputs(cos, sin)
        if self.qk_norm:  # Qwen3: per-head RMSNorm on q and k before rope
            rope = RopeInputs(cos, sin, self.q_norm, self.k_norm)
        o = self.attn(q, k, v, meta, rope=rope)  # [T, H * D]
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    def __init__(self, hf_config, opts: DecoderOptions, ctx: ModelContext, layer_idx: int = 0):
        super().__init__()
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported: must be 'silu'")
        inter = hf_config.intermediate_size
        prefix = f"model.layers.{layer_idx}.mlp."
        gate_up = layer_quant(opts.quant, [prefix + "gate_proj", prefix + "up_proj"])
        self.gate_up_proj = MergedColumnParallelLinear(
            hf_config.hidden_size, [inter, inter], bias=opts.mlp_bias, comm=ctx.comm, quant=gate_up
        )
        down = layer_quant(opts.quant, [prefix + "down_proj"])
        self.down_proj = RowParallelLinear(
            inter, hf_config.hidden_size, bias=opts.mlp_bias, comm=ctx.comm, quant=down
        )
        self.act_fn = SiluAndMul(quant_group=input_group(self.down_proj))  # FP8: fused quant

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hf_config, opts: DecoderOptions, layer_idx: int, ctx: ModelContext):
        super().__init__()
        self.self_attn = LlamaAttention(hf_config, opts, layer_idx, ctx)
        self.mlp = LlamaMLP(hf_config, opts, ctx, layer_idx)
        eps = hf_config.rms_norm_eps
        # before block-scaled FP8 q/k/v and gate/up the norms write FP8 themselves (fused quant)
        qkv_group = input_group(self.self_attn.qkv_proj)
        gate_up_group = input_group(self.mlp.gate_up_proj)
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps=eps, quant_group=qkv_group)
        self.post_attention_layernorm = RMSNorm(
            hf_config.hidden_size, eps=eps, quant_group=gate_up_group
        )

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        residual: torch.Tensor | None,  # [T, hidden]; None on the first layer
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, cos, sin, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, hf_config, opts: DecoderOptions, ctx: ModelContext):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            hf_config.vocab_size, hf_config.hidden_size, comm=ctx.comm
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(hf_config, opts, i, ctx) for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, eps=hf_config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(hf_config, head_dim_of(hf_config))

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        embeds=None,
    ) -> torch.Tensor:  # fmt: skip
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        if embeds is not None:  # prompt embeddings (``StepEmbeds``) instead of some ids'
            hidden = embeds.scatter(hidden)
        cos, sin = self.rotary_emb(positions, hidden.dtype)  # [T, head_dim] each
        residual = None
        for layer in self.layers:
            hidden, residual = layer(hidden, residual, cos, sin, meta)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class LlamaForCausalLM(nn.Module):
    """Causal LM for Llama-style checkpoints; subclasses only change ``decoder_options``.

    Implements ``hf_paged.models.protocol.PagedModel``: one uniform ``KVCacheSpec`` per layer,
    ``load_weights`` through ``models/loader.py``, decode safe in CUDA graphs.

    Args:
        hf_config: the HF config (LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config).
        ctx: attention backend and tensor-parallel communicator.

    Raises:
        ValueError: head counts or sizes that do not split over ``ctx.tp_size``; unsupported
            ``hidden_act`` or ``rope_type``.
    """

    # HF checkpoint module name -> (our fused module name, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # no host syncs in the decode path (dynamic rope switches with torch.where on the device);
    # whether the attention backends may be captured is the runner's check (ctx)
    supports_cuda_graph = True

    def __init__(self, hf_config, ctx: ModelContext):
        super().__init__()
        self.hf_config = hf_config
        # FP8 checkpoints: the quantized linears get float8 weights and their scales
        self.options = dataclasses.replace(
            self.decoder_options(hf_config), quant=fp8_config_of(hf_config)
        )
        self.model = LlamaModel(hf_config, self.options, ctx)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, comm=ctx.comm)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        attn = [layer.self_attn for layer in self.model.layers]
        self.kv_cache_specs = [
            KVCacheSpec(a.num_kv_heads, a.head_dim, a.head_dim, a.attn.spec.sliding_window)
            for a in attn
        ]

    @staticmethod
    def unsupported_refusal(hf_config) -> Refusal | None:
        """Why the native decoder refuses ``hf_config`` before building it (``model_impl="auto"``
        then takes the generic path), or None: an activation other than SiLU, a rope the
        native ``RotaryEmbedding`` does not build, an FP8 layout the fused layers can't hold."""
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            return Refusal("hidden_act", f"hidden_act={act!r}: the native MLP is SiLU-gated")
        try:
            RotaryEmbedding(hf_config, head_dim_of(hf_config))
        except ValueError as e:
            return Refusal("rope", str(e))
        return fp8_layout_refusal(hf_config)

    @staticmethod
    def tp_refusal(hf_config, tp_size: int) -> Refusal | None:
        """Why the MLP does not split over ``tp_size`` ranks (None: it does); the heads are
        judged by ``registry.tp_split_refusal``, the vocabulary is padded to fit."""
        inter = hf_config.intermediate_size
        if inter % tp_size == 0:
            return None
        return Refusal(
            "tensor_parallel_size",
            f"tensor_parallel_size={tp_size} is not allowed for this model: its "
            f"intermediate_size={inter} does not split over {tp_size} ranks; "
            f"tensor_parallel_size must divide {inter}",
        )

    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bool(getattr(hf_config, "mlp_bias", False)),
            qk_norm=False,
            sliding_windows=(None,) * hf_config.num_hidden_layers,
        )

    def load_weights(self, source) -> None:
        """From a safetensors checkpoint dir or an in-memory HF model (see ``models/loader``)."""
        loader.load_weights(self, source)

    def refresh_weights(self, weights, dry_run: bool = False) -> int:
        """Copy ``(HF name, full tensor)`` pairs into the parameters they load into, in place
        (``loader.refresh_weights``; ``dry_run``: judge them, write nothing). Returns how many
        were copied."""
        return loader.refresh_weights(self, weights, dry_run)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        embeds=None,  # StepEmbeds: prompt-embedding rows (``worker/step_inputs.py``)
    ) -> torch.Tensor:  # [T, hidden]
        if embeds is not None and embeds.deepstack is not None:
            raise ValueError("the native decoder takes no DeepStack rows (a Qwen3-VL input)")
        return self.model(input_ids, positions, meta, embeds)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, hidden] -> [N, vocab] logits in the model dtype on rank 0; None on other ranks."""
        return self.lm_head(hidden)


class MistralForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        window = getattr(hf_config, "sliding_window", None)
        return DecoderOptions(
            qkv_bias=False,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=(window,) * hf_config.num_hidden_layers,
        )


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        return DecoderOptions(
            qkv_bias=True,
            o_bias=False,
            mlp_bias=False,
            qk_norm=False,
            sliding_windows=windows_from_layer_types(hf_config),
        )


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def decoder_options(cls, hf_config) -> DecoderOptions:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return DecoderOptions(
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=False,
            qk_norm=True,
            sliding_windows=windows_from_layer_types(hf_config),
        )
