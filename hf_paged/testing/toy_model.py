"""A toy model path for protocol tests: not Llama, two attention layers with different KV specs
(kv heads, K head dim, V head dim != K head dim, score softcap), one rotated by the attention
layer (``rope=RopeInputs``), one handed pre-rotated q/k (``rope=None``, as the generic path does).

It implements ``hf_paged.models.protocol.PagedModel`` and nothing else the engine could lean on;
``dense_logits`` is an independent, cache-free oracle of the same math.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.kv_cache import KVCacheSpec
from hf_paged.layers.attention import Attention, RopeInputs
from hf_paged.layers.context import ModelContext
from hf_paged.layers.rotary import apply_rotary_emb, default_inv_freq

ARCH = "ToyPagedForCausalLM"
# per layer: (num_heads, num_kv_heads, head_dim, head_dim_v, softcap, layer rotates q/k itself);
# a config may carry its own table as ``toy_layers``
LAYERS = [(4, 2, 16, 16, None, True), (2, 1, 32, 24, 5.0, False)]
# no score modifier, K head dim = V head dim (the Triton kernels' plain path)
TRITON_LAYERS = [(4, 2, 16, 16, None, True), (2, 1, 32, 32, None, False)]
# layer 1's head dim is past the Triton kernels' 256: it gets the torch reference
FALLBACK_LAYERS = [(4, 2, 16, 16, None, True), (2, 1, 320, 24, 5.0, False)]


def rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq[None, :]  # [T, head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, head_dim]
    return emb.cos(), emb.sin()


class ToyLayer(nn.Module):
    def __init__(self, hidden: int, layer: tuple, layer_idx: int, ctx: ModelContext):
        super().__init__()
        h, hkv, d, dv, softcap, self.own_rope = layer
        self.shape = (h, hkv, d, dv)
        self.softcap = softcap
        self.q = nn.Linear(hidden, h * d, bias=False)
        self.k = nn.Linear(hidden, hkv * d, bias=False)
        self.v = nn.Linear(hidden, hkv * dv, bias=False)
        self.o = nn.Linear(h * dv, hidden, bias=False)
        spec = AttentionLayerSpec(h, hkv, d, d**-0.5, head_dim_v=dv, softcap=softcap)
        self.attn = Attention(spec, ctx, layer_idx)
        # a buffer on the build device: no host-to-device copy inside a captured graph
        self.register_buffer("inv_freq", default_inv_freq(10000.0, d), persistent=False)

    def forward(self, x, positions, meta: AttentionMetadata) -> torch.Tensor:  # [T, hidden]
        h, hkv, d, _ = self.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        cos, sin = rope(positions, self.inv_freq)
        if self.own_rope:
            return self.o(self.attn(q, k, v, meta, rope=RopeInputs(cos, sin)))
        q = apply_rotary_emb(q.view(-1, h, d), cos, sin)
        k = apply_rotary_emb(k.view(-1, hkv, d), cos, sin)
        return self.o(self.attn(q, k, v, meta))

    def dense(self, x: torch.Tensor) -> torch.Tensor:  # [S, hidden], causal, no cache
        h, hkv, d, dv = self.shape
        s = x.shape[0]
        cos, sin = rope(torch.arange(s, device=x.device), self.inv_freq)
        q = apply_rotary_emb(self.q(x).view(s, h, d), cos, sin).transpose(0, 1)  # [h, S, d]
        k = apply_rotary_emb(self.k(x).view(s, hkv, d), cos, sin).transpose(0, 1)
        v = self.v(x).view(s, hkv, dv).transpose(0, 1)  # [hkv, S, dv]
        k, v = k.repeat_interleave(h // hkv, 0), v.repeat_interleave(h // hkv, 0)
        scores = q @ k.transpose(1, 2) * d**-0.5  # [h, S, S]
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        return self.o((probs @ v).transpose(0, 1).reshape(s, h * dv))


class ToyPagedForCausalLM(nn.Module):
    """Embedding, two residual attention layers, lm head; weights named as in ``state_dict``."""

    supports_cuda_graph = True

    def __init__(self, hf_config, ctx: ModelContext):
        super().__init__()
        hidden = hf_config.hidden_size
        self.embed = nn.Embedding(hf_config.vocab_size, hidden)
        table = [tuple(t) for t in getattr(hf_config, "toy_layers", None) or LAYERS]
        self.layers = nn.ModuleList(ToyLayer(hidden, t, i, ctx) for i, t in enumerate(table))
        self.lm_head = nn.Linear(hidden, hf_config.vocab_size, bias=False)
        self.kv_cache_specs = [KVCacheSpec(hkv, d, dv) for _, hkv, d, dv, _, _ in table]

    def load_weights(self, source) -> None:
        from safetensors.torch import load_file

        if isinstance(source, nn.Module):
            state = source.state_dict()
        else:
            state = load_file(str(Path(source) / "model.safetensors"))
        with torch.no_grad():
            self.load_state_dict(state, strict=True)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed(input_ids)  # [T, hidden]
        for layer in self.layers:
            x = x + layer(x, positions, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def dense_logits(self, ids: list[int]) -> torch.Tensor:  # [S, vocab]
        x = self.embed(torch.tensor(ids))
        for layer in self.layers:
            x = x + layer.dense(x)
        return self.lm_head(x)


def save_toy_model(path, seed: int = 0, layers=None, vocab_size: int = 96, hidden_size: int = 32):
    """Write config.json (a LlamaConfig naming ``ARCH``, with ``toy_layers``) and
    model.safetensors; returns the model (fp32, random weights scaled so greedy outputs vary)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from hf_paged.attention.torch_ref import TorchRefBackend

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=len(LAYERS),
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
        max_position_embeddings=128, architectures=[ARCH], toy_layers=layers or LAYERS,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = ToyPagedForCausalLM(config, ModelContext(TorchRefBackend()))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(Path(path) / "model.safetensors"))
    return model.eval()
