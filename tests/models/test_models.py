"""Native Llama-family models against HF transformers on tiny random fp32 checkpoints.

Every family is saved with ``save_pretrained`` (safetensors), loaded with our loader, and run as
one ragged paged batch (prompts of 1, 7 and 33 tokens) on the torch reference attention backend;
logits must match HF's unpadded per-prompt forward at every position, then again for one decode
step per sequence.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.layers.attention import Attention
from hf_paged.layers.context import ModelContext
from hf_paged.models.loader import load_weights
from hf_paged.models.registry import build_model, get_model_class, is_supported
from hf_paged.testing import (
    FAMILIES,
    ThreadGroup,
    build_hf_model,
    make_kv_cache,
    run_ranks,
    run_step,
    tiny_config,
)

BLOCK_SIZE = 8
MAX_BLOCKS = 6  # 48 tokens per sequence
PROMPT_LENS = (1, 7, 33)

# name -> (family, config overrides)
VARIANTS = {
    "llama": ("llama", {}),
    "llama_linear_rope": (
        "llama",
        {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
    ),
    "llama3_rope": ("llama3_rope", {}),
    "llama_yarn_rope": (
        "llama",
        {
            "rope_parameters": {
                "rope_type": "yarn",
                "factor": 4.0,
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama_tied_kv1_bias": (
        "llama",
        {
            "tie_word_embeddings": True,
            "num_key_value_heads": 1,
            "attention_bias": True,
            "mlp_bias": True,
        },
    ),
    "mistral_sliding": ("mistral", {}),
    "qwen2": ("qwen2", {}),
    "qwen2_sliding": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
    ),
    "qwen3_tied": ("qwen3", {}),
    "qwen3_untied_kv1": ("qwen3", {"tie_word_embeddings": False, "num_key_value_heads": 1}),
}


def _ctx() -> ModelContext:
    return ModelContext(TorchRefBackend())


def _prompts(lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lens]


def _hf_logits(hf, seq: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0]


def _native(hf_config, source, dtype=torch.float32):
    model = build_model(hf_config, _ctx(), dtype=dtype)
    load_weights(model, source)
    return model, make_kv_cache(model, len(PROMPT_LENS) * MAX_BLOCKS, BLOCK_SIZE)


def _check_prefill_and_decode(model, kv, hf) -> None:
    seqs = _prompts()
    outs = run_step(model, kv, seqs, [len(s) for s in seqs], BLOCK_SIZE, MAX_BLOCKS)
    for seq, out in zip(seqs, outs, strict=True):
        torch.testing.assert_close(out, _hf_logits(hf, seq), atol=1e-4, rtol=1e-4)
    # decode: one more token per sequence, attending to the cached prompt
    seqs = [s + [int(o[-1].argmax())] for s, o in zip(seqs, outs, strict=True)]
    outs = run_step(model, kv, seqs, [1] * len(seqs), BLOCK_SIZE, MAX_BLOCKS)
    for seq, out in zip(seqs, outs, strict=True):
        torch.testing.assert_close(out[0], _hf_logits(hf, seq)[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_safetensors_prefill_and_decode_match_hf(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    hf = build_hf_model(family, seed=0, **overrides)
    hf.save_pretrained(tmp_path)
    model, kv = _native(hf.config, tmp_path)
    assert type(model).__name__ == hf.config.architectures[0]
    _check_prefill_and_decode(model, kv, hf)


def test_sliding_window_changes_hf_logits():
    """Guards the sliding-window parity tests: the window must matter on these prompts."""
    seq = _prompts((33,))[0]
    windowed = _hf_logits(build_hf_model("mistral", sliding_window=8), seq)
    full = _hf_logits(build_hf_model("mistral", sliding_window=None), seq)
    assert not torch.allclose(windowed[-1], full[-1], atol=1e-2)


@pytest.mark.parametrize("family", ["mistral", "qwen3"])
def test_chunked_prefill_matches_hf(family, tmp_path):
    hf = build_hf_model(family)
    hf.save_pretrained(tmp_path)
    model, kv = _native(hf.config, tmp_path)
    seq = _prompts((33,))[0]
    ref = _hf_logits(hf, seq)
    (first,) = run_step(model, kv, [seq[:20]], [20], BLOCK_SIZE, MAX_BLOCKS)
    (second,) = run_step(model, kv, [seq], [13], BLOCK_SIZE, MAX_BLOCKS)
    torch.testing.assert_close(torch.cat([first, second]), ref, atol=1e-4, rtol=1e-4)


def test_sharded_checkpoint_loads_identically(tmp_path):
    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "single")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="50KB")
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    seqs = _prompts()
    outs = {}
    for name in ("single", "sharded"):
        model, kv = _native(hf.config, tmp_path / name)
        outs[name] = run_step(model, kv, seqs, [len(s) for s in seqs], BLOCK_SIZE, MAX_BLOCKS)
    for a, b in zip(outs["single"], outs["sharded"], strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_in_memory_load_shares_storage(family):
    hf = build_hf_model(family)
    model, kv = _native(hf.config, hf)
    ours, theirs = model.model.layers[1], hf.model.layers[1]
    for a, b in [
        (ours.self_attn.o_proj.weight, theirs.self_attn.o_proj.weight),
        (ours.mlp.down_proj.weight, theirs.mlp.down_proj.weight),
        (ours.input_layernorm.weight, theirs.input_layernorm.weight),
        (model.model.embed_tokens.weight, hf.model.embed_tokens.weight),
        (model.model.norm.weight, hf.model.norm.weight),
        (model.lm_head.weight, hf.lm_head.weight),
    ]:
        assert a.data_ptr() == b.data_ptr()
    if hf.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    # fused projections are copies
    assert ours.self_attn.qkv_proj.weight.data_ptr() != theirs.self_attn.q_proj.weight.data_ptr()
    _check_prefill_and_decode(model, kv, hf)


def test_in_memory_load_converts_dtype_without_sharing():
    hf = build_hf_model("qwen2")
    model = build_model(hf.config, _ctx(), dtype=torch.bfloat16)
    load_weights(model, hf)
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    assert o_proj.dtype == torch.bfloat16
    assert o_proj.data_ptr() != hf.model.layers[0].self_attn.o_proj.weight.data_ptr()
    assert torch.equal(o_proj, hf.model.layers[0].self_attn.o_proj.weight.to(torch.bfloat16))
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    assert bias.dtype == torch.bfloat16 and bias.shape == (64 + 2 * 2 * 16,)


def test_build_model_is_cheap_and_leaves_torch_state():
    before = torch.get_default_dtype()
    model = build_model(tiny_config("llama3_rope"), _ctx(), dtype=torch.bfloat16)
    assert torch.get_default_dtype() == before
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.empty(1).device.type == "cpu"


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")
def test_dynamic_ntk_rope_matches_hf_incremental_decode(tmp_path):
    """Dynamic NTK recomputes frequencies past max_position_embeddings (16 here); single
    sequence, so the batch-max caveat does not apply and HF's stateful update matches."""
    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    hf = build_hf_model("llama", rope_parameters=rope, max_position_embeddings=16)
    hf.save_pretrained(tmp_path)
    model, kv = _native(hf.config, tmp_path)
    seq = _prompts((33,))[0]
    with torch.no_grad():
        out = hf(torch.tensor([seq]), use_cache=True)
        nxt = int(out.logits[0, -1].argmax())
        step = hf(torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True)
    (prefill,) = run_step(model, kv, [seq], [33], BLOCK_SIZE, MAX_BLOCKS)
    torch.testing.assert_close(prefill, out.logits[0], atol=1e-4, rtol=1e-4)
    (decode,) = run_step(model, kv, [seq + [nxt]], [1], BLOCK_SIZE, MAX_BLOCKS)
    torch.testing.assert_close(decode[0], step.logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)],
            "long_factor": [2.0 + 0.3 * i for i in range(8)],
        },
    ],
    ids=lambda r: r["rope_type"],
)
@pytest.mark.parametrize("num_positions", [10, 40])
def test_rotary_cos_sin_match_hf(rope, num_positions):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from hf_paged.layers.rotary import RotaryEmbedding

    config = tiny_config("llama", rope_parameters=dict(rope), max_position_embeddings=32)
    ours = RotaryEmbedding(config, head_dim=16)
    theirs = LlamaRotaryEmbedding(config)
    positions = torch.arange(num_positions)
    x = torch.empty(1, num_positions, 16)
    cos_ref, sin_ref = theirs(x, positions[None])
    cos, sin = ours(positions, torch.float32)
    torch.testing.assert_close(cos, cos_ref[0], atol=0, rtol=0)
    torch.testing.assert_close(sin, sin_ref[0], atol=0, rtol=0)


def test_registry_resolves_each_family():
    expected = {
        "llama": "LlamaForCausalLM",
        "llama3_rope": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }
    for family in FAMILIES:
        config = tiny_config(family)
        assert get_model_class(config).__name__ == expected[family]
        assert is_supported(config)
        config.architectures = None  # configs built in code: fall back to model_type
        assert get_model_class(config).__name__ == expected[family]


def test_unknown_architecture_lists_supported():
    config = tiny_config("llama")
    config.architectures = ["GPT2LMHeadModel"]
    assert not is_supported(config, "native")
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as err:
        get_model_class(config)
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in str(err.value)


def _rewrite_checkpoint(src, dst, edit) -> None:
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    dst.mkdir()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def test_missing_and_unexpected_weights_are_named(tmp_path):
    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "good")
    model = build_model(hf.config, _ctx())

    def drop(t):
        del t["model.layers.1.self_attn.k_proj.weight"]
        del t["lm_head.weight"]

    _rewrite_checkpoint(tmp_path / "good", tmp_path / "missing", drop)
    with pytest.raises(ValueError, match="missing weights") as err:
        load_weights(model, tmp_path / "missing")
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)
    assert "lm_head.weight" in str(err.value)

    def extra(t):
        t["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
        t["model.rotary_emb.inv_freq"] = torch.zeros(8)  # ignored, never "unexpected"

    _rewrite_checkpoint(tmp_path / "good", tmp_path / "extra", extra)
    with pytest.raises(ValueError, match="unexpected weights") as err:
        load_weights(model, tmp_path / "extra")
    assert "extra_proj" in str(err.value) and "inv_freq" not in str(err.value)


def test_wrong_shape_names_the_tensor(tmp_path):
    hf = build_hf_model("llama")
    hf.save_pretrained(tmp_path / "good")

    def bad(t):
        t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(64, 64)

    _rewrite_checkpoint(tmp_path / "good", tmp_path / "bad", bad)
    with pytest.raises(ValueError, match="model.layers.0.mlp.up_proj.weight"):
        load_weights(build_model(hf.config, _ctx()), tmp_path / "bad")


def test_missing_checkpoint_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_weights(build_model(tiny_config("llama"), _ctx()), tmp_path)


def _windows(config) -> list[int | None]:
    model = build_model(config, _ctx())
    return [m.spec.sliding_window for m in model.modules() if isinstance(m, Attention)]


def test_sliding_window_follows_transformers_configs():
    # Qwen2/Qwen3: sliding_window is nulled unless use_sliding_window; then layers from
    # max_window_layers on slide
    assert _windows(tiny_config("qwen2", sliding_window=8)) == [None, None]
    on = dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert _windows(tiny_config("qwen2", **on)) == [None, 8]
    assert _windows(tiny_config("qwen3", **on)) == [None, 8]
    # Mistral: one window on every layer; layer_types is ignored, as MistralModel does
    assert _windows(tiny_config("mistral", sliding_window=8)) == [8, 8]
    mixed = tiny_config("mistral", sliding_window=8, layer_types=["full_attention"] * 2)
    assert _windows(mixed) == [8, 8]
    assert _windows(tiny_config("mistral", sliding_window=None)) == [None, None]
    # Llama never slides
    assert _windows(tiny_config("llama")) == [None, None]


@pytest.mark.parametrize(
    "family, overrides, tp",
    [
        ("llama", {}, 2),  # kv heads split
        ("llama", {}, 4),  # 2 kv heads replicated over 4 ranks
        ("qwen3", {"num_key_value_heads": 1}, 2),  # 1 kv head replicated, tied embeddings
        ("qwen2", {"vocab_size": 255}, 2),  # vocab padded to a multiple of tp
    ],
)
def test_tensor_parallel_ranks_in_threads_match_hf(family, overrides, tp, tmp_path):
    """Each rank loads only its shard from safetensors; collectives run between threads."""
    hf = build_hf_model(family, **overrides)
    hf.save_pretrained(tmp_path)
    seqs = _prompts()
    seqs = [[t % hf.config.vocab_size for t in s] for s in seqs]
    comms = ThreadGroup(tp).comms()

    def rank_main(rank):
        ctx = ModelContext(TorchRefBackend(), comms[rank])
        model = build_model(hf.config, ctx)
        load_weights(model, tmp_path)
        attn = model.model.layers[0].self_attn
        assert attn.num_heads == hf.config.num_attention_heads // tp
        assert attn.num_kv_heads == max(1, hf.config.num_key_value_heads // tp)
        kv = make_kv_cache(model, len(seqs) * MAX_BLOCKS, BLOCK_SIZE)
        prefill = run_step(model, kv, seqs, [len(s) for s in seqs], BLOCK_SIZE, MAX_BLOCKS)
        return prefill if rank == 0 else prefill == [None] * len(seqs)

    results = run_ranks(rank_main, tp)
    assert all(r is True for r in results[1:])  # other ranks get no logits
    for seq, out in zip(seqs, results[0], strict=True):
        torch.testing.assert_close(out, _hf_logits(hf, seq), atol=1e-4, rtol=1e-4)


def test_auto_takes_generic_for_an_activation_native_refuses():
    """A llama with GELU: the native MLP raised at build under model_impl="auto"; now "auto"
    serves it on the generic path with stock's tokens, and "native" names the refusal."""
    from hf_paged.models.registry import resolve_model_class, unsupported_refusal
    from hf_paged.testing import left_pad, make_prompts, stock_and_paged

    hf = build_hf_model("llama", seed=0, hidden_act="gelu")
    assert resolve_model_class(hf.config, "auto").__name__ == "GenericForCausalLM"
    assert unsupported_refusal(hf.config, "native").reason == "hidden_act"
    ids, mask = left_pad(make_prompts([3, 6], seed=2))
    stock, paged, *_ = stock_and_paged(
        hf, input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False,
        pad_token_id=0, paged_config={"kv_block_size": 4, "max_model_len": 32},
    )  # fmt: skip
    assert torch.equal(stock, paged)


def test_tp_split_problem_names_an_mlp_that_does_not_split():
    """``intermediate_size`` 37 over 2 ranks: each path refuses by name before a worker starts
    (the native decoder said only 'output_sizes[i]=37 is not divisible by tp_size=2', from a
    worker)."""
    from hf_paged.models.registry import tp_split_refusal

    odd = tiny_config("llama", intermediate_size=37)
    native = tp_split_refusal(odd, 2, "native")
    assert native.reason == "tensor_parallel_size"
    assert "tensor_parallel_size=2 is not allowed" in native.detail
    assert "intermediate_size=37" in native.detail
    generic = tp_split_refusal(odd, 2, "generic")
    assert "mlp.gate_proj.weight has 37 along dim 0" in generic.detail
    assert tp_split_refusal(odd, 1, "native") is None
    assert tp_split_refusal(tiny_config("llama"), 2, "native") is None
    assert tp_split_refusal(tiny_config("llama"), 2, "generic") is None
