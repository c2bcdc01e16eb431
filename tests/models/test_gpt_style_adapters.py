"""Attention adapters (``hf_paged/models/generic/adapters/``) for GPT-Neo, Falcon, Bloom, MPT,
OpenAI GPT, XGLM and GPT-NeoX-Japanese, plus DBRX and Llama 4 text on the generic path: greedy
tokens equal stock ``generate``'s on left-padded batches (prompts of 1, 4, 5 and 9 tokens, KV
blocks of 4), for each family's default tiny config and the config options its adapter
branches on; prefix caching with chunked prefill; the refusals (tensor parallelism, Llama 4's
lengths, ALiBi on classes without an adapter)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import CONFIG_MAPPING

from hf_paged import PagedFallbackWarning, release
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.integration.fallback import reset_fallback_warnings
from hf_paged.testing import build_tiny, left_pad, parity, shrink_config
from tests.models.coverage_models import (
    BLOCK_SIZE,
    MAX_NEW_TOKENS,
    _generate,
    not_text_reason,
    prompts,
)

# name -> (model_type, config overrides on the coverage test's tiny config, why it is here)
VARIANTS = {
    "gpt_neo": ("gpt_neo", {}, "global + local layers, window wider than the sequences"),
    "gpt_neo_window3": ("gpt_neo", {"window_size": 3}, "local layer's window binds"),
    "falcon": ("falcon", {}, "multi-query, rotary, parallel attention"),
    "falcon_new_arch": ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2},
                        "grouped KV heads packed per group"),
    "falcon_mha_seq": ("falcon", {"multi_query": False, "num_kv_heads": 4,
                                  "parallel_attn": False, "bias": True},
                       "per-head packed QKV, sequential block, biases"),
    "falcon_alibi": ("falcon", {"alibi": True}, "ALiBi instead of rotary"),
    "falcon_alibi_3h": ("falcon", {"alibi": True, "hidden_size": 48, "num_attention_heads": 3},
                        "ALiBi slopes of a head count that is not a power of two"),
    "bloom": ("bloom", {}, "ALiBi"),
    "bloom_6h_tp_slices": ("bloom", {"hidden_size": 96, "n_head": 6, "pretraining_tp": 2,
                                     "slow_but_exact": True,
                                     "apply_residual_connection_post_layernorm": True},
                           "non-power-of-two slopes, sliced output projection"),
    "mpt": ("mpt", {}, "ALiBi from the model's position_bias"),
    "mpt_6h_clip_scale": ("mpt", {"d_model": 96, "n_heads": 6,
                                  "attn_config": {"clip_qkv": 0.5, "softmax_scale": 0.3}},
                          "clipped QKV, own softmax scale, 6 heads"),
    "openai-gpt": ("openai-gpt", {}, "Conv1D projections, -1e4 causal mask"),
    "xglm": ("xglm", {}, "pre-scaled query, scaled embeddings"),
    "xglm_unscaled": ("xglm", {"scale_embedding": False}, "unscaled embeddings"),
    "gpt_neox_japanese": ("gpt_neox_japanese", {}, "per-head packed QKV, last-layer bias"),
    "gpt_neox_japanese_partial": (
        "gpt_neox_japanese",
        {"rope_parameters": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                             "rope_type": "default"}},
        "rotary on half the head dims",
    ),
    "dbrx": ("dbrx", {}, "counted as a text model; MoE with clipped QKV"),
    "llama4_text": ("llama4_text", {}, "chunked attention with max_model_len <= chunk"),
}  # fmt: skip
ENGINE = dict(kv_block_size=BLOCK_SIZE, max_model_len=64, num_kv_blocks=64)
ADAPTED = ["gpt_neo", "falcon", "bloom", "mpt", "openai-gpt", "xglm", "gpt_neox_japanese"]


def build(model_type: str, **overrides):
    """Tiny random fp32 model: the coverage test's config for ``model_type`` + ``overrides``."""
    return build_tiny(model_type, **overrides)[1]


def paged_vs_stock(model, ids, mask, **engine):
    """(stock tokens, paged tokens, fallback messages, the engine's model or None)."""
    with torch.no_grad():
        ref = _generate(model, ids, mask)
    reset_fallback_warnings()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            out = _generate(model, ids, mask, backend="paged", paged_config={**ENGINE, **engine})
        slot = existing_owner(model)
        served = slot.engine.executor.runner.model if slot and slot.engine else None
    finally:
        release(model)
    fell = [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
    return ref, out, fell, served


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_left_padded_parity(name):
    model_type, overrides, _ = VARIANTS[name]
    model = build(model_type, **overrides)
    ids, mask = prompts(model.config.get_text_config().vocab_size)
    ref, out, fell, served = paged_vs_stock(model, ids, mask)
    assert fell == [] and served is not None
    assert out.shape[1] == ids.shape[1] + MAX_NEW_TOKENS
    assert torch.equal(out, ref)


def test_profile_reads_the_adapters_options():
    """What each adapter passed reaches the layer specs: GPT-Neo's local window on its local
    layer, unit scale; Falcon's ALiBi slopes (bfloat16-rounded, times 1/sqrt(d)) and grouped
    KV heads; Bloom's unscaled slopes."""
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    specs = {}
    for name in ("gpt_neo_window3", "falcon_alibi", "falcon_new_arch", "bloom"):
        model_type, overrides, _ = VARIANTS[name]
        model = build(model_type, **overrides)
        ids, mask = prompts(model.config.vocab_size)
        *_, served = paged_vs_stock(model, ids, mask)
        specs[name] = served.layer_specs
    assert [s.sliding_window for s in specs["gpt_neo_window3"]] == [None, 3]
    assert {s.scale for s in specs["gpt_neo_window3"]} == {1.0}
    falcon = specs["falcon_alibi"][0]
    assert falcon.alibi_slopes == pytest.approx([s / 4 for s in (2**-2, 2**-4, 2**-6, 2**-8)])
    assert (falcon.num_heads, falcon.num_kv_heads) == (4, 1)  # multi-query
    assert {(s.num_heads, s.num_kv_heads) for s in specs["falcon_new_arch"]} == {(4, 2)}
    slopes = build_alibi_tensor(torch.ones(1, 2), 4, torch.float32)[:, 0, 1].tolist()
    assert specs["bloom"][0].alibi_slopes == pytest.approx(slopes)
    assert specs["bloom"][0].scale == pytest.approx(16**-0.5)


@pytest.mark.parametrize("name", ["falcon_alibi", "gpt_neo_window3", "mpt"])
def test_prefix_caching_and_chunked_prefill(name):
    """A shared prefix (cache hits) with prefill chunks of 5 tokens, vs stock per prompt."""
    model_type, overrides, _ = VARIANTS[name]
    model = build(model_type, **overrides)
    shared = [3 + (i * 13) % 180 for i in range(10)]
    batch = [shared + [5 + i, 7 + 2 * i, 11 + i][: 1 + i % 3] for i in range(5)] + [[9]]
    ref = parity.hf_greedy(model, batch, new_tokens=MAX_NEW_TOKENS)
    got, stats = parity.paged_greedy(
        model, batch, new_tokens=MAX_NEW_TOKENS, max_model_len=64, kv_block_size=BLOCK_SIZE,
        num_kv_blocks=64, enable_prefix_caching=True, max_num_batched_tokens=5, max_num_seqs=3,
    )  # fmt: skip
    assert stats["prefix_cache_hit_tokens"] > 0
    assert got == ref


@pytest.mark.parametrize("model_type", ADAPTED)
def test_tensor_parallel_refused_by_name(model_type):
    """No adapted family has a TP plan: tp_size 2 is refused with a named reason."""
    from hf_paged.attention import get_backend
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.generic.support import UnsupportedModelError
    from hf_paged.models.registry import build_model
    from hf_paged.testing import FakeComm

    config = shrink_config(CONFIG_MAPPING[model_type]())
    ctx = ModelContext(get_backend("torch"), FakeComm(0, 2), max_model_len=64)
    with pytest.raises(UnsupportedModelError, match="has no tensor-parallel plan"):
        build_model(config, ctx, torch.float32, "cpu", "generic")


def _llama4(**overrides):
    return build("llama4_text", **overrides)


def test_llama4_chunked_attention_needs_one_chunk():
    """Served while max_model_len <= attention_chunk_size; longer engines fall back, named."""
    model = _llama4(attention_chunk_size=32)
    ids, mask = prompts(model.config.vocab_size)
    ref, out, fell, _ = paged_vs_stock(model, ids, mask, max_model_len=32)
    assert fell == [] and torch.equal(out, ref)
    _, out, fell, served = paged_vs_stock(model, ids, mask, max_model_len=33)
    assert served is None and torch.equal(out, ref)
    assert len(fell) == 1 and "attention_chunk_size=32" in fell[0]
    assert "max_model_len=33 must be <= 32" in fell[0]


def test_llama4_temperature_tuning_on_long_flattened_rows():
    """NoPE layers' temperature tuning reads indices of the row HF runs: stock's (one padded
    row per sequence) stay below floor_scale - 1, the flattened prefill row (37 tokens) does
    not. The adapter keeps the scale at 1 as stock's is; an engine whose max_model_len reaches
    floor_scale falls back, named."""
    model = _llama4(attention_chunk_size=64, floor_scale=32, attn_scale=10.0)
    assert 0 in model.config.no_rope_layers and model.config.attn_temperature_tuning
    batch = [[3 + (7 * i + j) % 180 for j in range(n)] for i, n in enumerate((9, 9, 9, 5, 4, 1))]
    ids, mask = left_pad(batch)
    assert int(mask.sum()) == 37
    ref, out, fell, _ = paged_vs_stock(model, ids, mask, max_model_len=31)
    assert fell == [] and torch.equal(out, ref)
    _, out, fell, served = paged_vs_stock(model, ids, mask, max_model_len=32)
    assert served is None and len(fell) == 1 and "floor_scale=32" in fell[0]


def test_alibi_refused_without_an_adapter():
    """The ALiBi refusal is lifted for adapted classes only."""
    from hf_paged.models.generic.support import static_refusal

    falcon = shrink_config(CONFIG_MAPPING["falcon"]())
    falcon.alibi = True
    assert static_refusal(falcon) is None
    gpt2 = shrink_config(CONFIG_MAPPING["gpt2"]())
    gpt2.alibi = True
    assert "ALiBi position biases (alibi=True)" in static_refusal(gpt2).detail


def test_layer_sub_configs_are_text_models():
    """MPT's attn_config and DBRX's attn_config/ffn_config configure their own layers;
    vision and audio sub-configs still make a model multimodal."""
    assert not_text_reason(CONFIG_MAPPING["mpt"]()) is None
    assert not_text_reason(CONFIG_MAPPING["dbrx"]()) is None
    assert "vision_config" in not_text_reason(CONFIG_MAPPING["llama4"]())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_left_padded_parity_cuda(name):
    """The same parity on CUDA, fp32, through the GPU attention backend (the torch reference
    for any layer it reports it cannot compute)."""
    model_type, overrides, _ = VARIANTS[name]
    model = build(model_type, **overrides).to("cuda")
    ids, mask = (t.cuda() for t in prompts(model.config.get_text_config().vocab_size))
    ref, out, fell, served = paged_vs_stock(model, ids, mask, device="cuda")
    assert fell == [] and served is not None
    assert torch.equal(out, ref)
