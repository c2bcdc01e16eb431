"""The generic model path (HF modules + hf_paged attention) against stock greedy and against the
native path: checkpoints read by our loader (renames and merged MoE experts), KV pressure,
chunked prefill and prefix caching, for dense, sliding/softcapped, MoE and MLA models."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.testing import build_tiny, parity, save_tiny_model, spread_prompts

NEW_TOKENS = 16
MAX_LEN = 96
# model_type -> why it is here
ARCHS = {
    "gemma2": "sliding + full layers, attention and final softcaps, embed scale",
    "phi3": "fused qkv / gate_up in HF, partial rotary",
    "mixtral": "MoE; checkpoint stores per-expert weights that HF merges",
    "qwen3_moe": "MoE with q/k norms",
    "deepseek_v3": "MLA: K head dim 24, V head dim 16; shared experts",
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    _, model = build_tiny(request.param)
    path = str(tmp_path_factory.mktemp(request.param))
    model.save_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


def hf_greedy(hf, prompts):
    return parity.hf_greedy(hf, prompts, new_tokens=NEW_TOKENS)


def paged_greedy(model, prompts, **engine_kwargs):
    kwargs = dict(max_model_len=MAX_LEN, kv_block_size=4, **engine_kwargs)
    return parity.paged_greedy(model, prompts, new_tokens=NEW_TOKENS, **kwargs)


def test_checkpoint_defaults(arch):
    path, hf = arch
    prompts = spread_prompts(6, 2, 30, seed=1, vocab=hf.config.vocab_size)
    got, _ = paged_greedy(path, prompts)
    assert got == hf_greedy(hf, prompts)


def test_preemption_chunked_prefix(arch):
    """KV pressure (preemption), prefill chunks smaller than prompts, and a shared prefix."""
    path, hf = arch
    vocab = hf.config.vocab_size
    shared = [3 + (i * 13) % (vocab - 3) for i in range(10)]
    prompts = spread_prompts(6, 5, 24, seed=2, vocab=vocab, prefix=shared)
    ref = hf_greedy(hf, prompts)
    got, stats = paged_greedy(path, prompts, num_kv_blocks=MAX_LEN // 4, max_num_seqs=4)
    assert stats["num_preemptions"] > 0
    assert got == ref
    got, _ = paged_greedy(path, prompts, max_num_batched_tokens=5, max_num_seqs=3)
    assert got == ref
    got, stats = paged_greedy(path, prompts, enable_prefix_caching=True, max_num_seqs=2)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert got == ref


def test_in_memory_model_shares_storage(arch):
    path, hf = arch
    prompts = spread_prompts(4, 2, 20, seed=3, vocab=hf.config.vocab_size)
    with LLM(hf, max_model_len=MAX_LEN, kv_block_size=4, num_kv_blocks=128) as llm:
        model = llm.engine.executor.runner.model
        ours = {p.data_ptr() for p in model.parameters()}
        assert ours == {p.data_ptr() for p in hf.parameters()}  # no second copy
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(hf, prompts)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_generic_equals_native(family, tmp_path):
    """model_impl="generic" on the four native families gives the native path's tokens."""
    extra = {"sliding_window": 6} if family == "mistral" else {}
    path = save_tiny_model(family, tmp_path / family, seed=0, **extra)
    prompts = spread_prompts(6, 1, 30, seed=4, vocab=256)
    native, _ = paged_greedy(str(path), prompts, model_impl="native")
    generic, _ = paged_greedy(str(path), prompts, model_impl="generic")
    assert generic == native


def test_profile_records_per_layer_specs():
    """Gemma2: sliding and full layers, softcap 50, query_pre_attn_scalar scale; DeepSeek MLA:
    V head dim differs from K's."""
    from hf_paged.attention import get_backend
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.registry import build_model

    ctx = ModelContext(get_backend("torch"))
    config, hf = build_tiny("gemma2")
    model = build_model(config, ctx, torch.float32, "cpu", "generic")
    model.load_weights(hf)
    windows = [s.sliding_window for s in model.layer_specs]
    assert windows == [config.sliding_window if t == "sliding_attention" else None
                       for t in config.layer_types]  # fmt: skip
    assert {s.softcap for s in model.layer_specs} == {config.attn_logit_softcapping}
    assert model.layer_specs[0].scale == config.query_pre_attn_scalar**-0.5
    config, hf = build_tiny("deepseek_v3")
    model = build_model(config, ctx, torch.float32, "cpu", "generic")
    model.load_weights(hf)
    spec = model.kv_cache_specs[0]
    assert (spec.head_dim, spec.head_dim_v) == (
        config.qk_nope_head_dim + config.qk_rope_head_dim,
        config.v_head_dim,
    )
    assert spec.num_kv_heads == config.num_attention_heads


def test_native_impl_refuses_other_architectures():
    from hf_paged.models.generic import GenericForCausalLM
    from hf_paged.models.registry import resolve_model_class, unsupported_refusal

    config, _ = build_tiny("gemma2")
    assert resolve_model_class(config, "auto") is GenericForCausalLM
    assert unsupported_refusal(config) is None
    with pytest.raises(ValueError, match="not supported by hf_paged"):
        resolve_model_class(config, "native")
    with pytest.raises(ValueError, match="model_impl='x' is not allowed"):
        resolve_model_class(config, "x")


@pytest.mark.parametrize("model_type", ["qwen2", "mixtral", "gemma2", "llama4_text"])
def test_fusions_keep_tokens(model_type):
    """q/k/v and gate/up fused into one GEMM each (on CUDA by default; forced here on CPU):
    same logits as unfused, and the fused members' weights are views of one tensor."""
    from hf_paged.attention import get_backend
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.generic.fusions import FusedMemberLinear
    from hf_paged.models.registry import build_model
    from hf_paged.testing import build_metadata

    config, hf = build_tiny(model_type)
    logits = []
    for fuse in (False, True):
        ctx = ModelContext(get_backend("torch"), kv_block_size=4, max_model_len=64)
        model = build_model(config, ctx, torch.float32, "cpu", "generic")
        model.fuse = fuse
        model.load_weights(hf)
        from hf_paged.attention.kv_cache import KVCache

        meta, pos = build_metadata([5, 3], [5, 3], 4, 2)
        meta.kv_cache = KVCache(model.kv_cache_specs, 4, 4, torch.float32, "cpu")
        ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
        with torch.inference_mode():
            logits.append(model.compute_logits(model(ids, pos, meta)))
        if fuse:
            attn = model.hf_model.get_submodule("model.layers.0.self_attn")
            assert type(attn.q_proj) is FusedMemberLinear
            base = attn.q_proj.weight.untyped_storage().data_ptr()
            assert attn.v_proj.weight.untyped_storage().data_ptr() == base
            assert model.fusion_stats["fused_groups"] >= config.num_hidden_layers
            if model_type == "qwen2":  # Llama's RMSNorm and MLP, copied: the kernels on CUDA
                assert model.fusion_stats["paged_rms_norms"] == 2 * config.num_hidden_layers + 1
                assert model.fusion_stats["silu_and_mul_mlps"] == config.num_hidden_layers
                mlp = model.hf_model.get_submodule("model.layers.0.mlp")
                assert type(mlp).__name__ == "PagedQwen2MLP"
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-5, atol=1e-5)


def test_flattening_check_catches_token_mixing_layers(monkeypatch):
    """An LFM2 with convolution layers, their layer type let through the static check and
    their class unknown to the recurrent registry (no mixer runs them): the profile pass still
    refuses it, because flattened sequences do not stay independent."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from hf_paged.attention import get_backend
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.generic import support
    from hf_paged.models.generic.support import UnsupportedModelError
    from hf_paged.models.recurrent import registry
    from hf_paged.models.registry import build_model
    from hf_paged.testing import shrink_config

    config = shrink_config(CONFIG_MAPPING["lfm2"]())  # conv, full_attention, conv, conv
    assert "conv" in config.layer_types
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config).eval()
    monkeypatch.delitem(registry.MIXERS, "Lfm2ShortConv")  # as if no mixer ran its conv layers
    assert support.static_refusal(config) is not None  # refused up front by its layer type
    monkeypatch.setattr(support, "_ATTENTION_LAYER_TYPES", {"full_attention", "conv"})
    model = build_model(config, ModelContext(get_backend("torch")), torch.float32, "cpu")
    with pytest.raises(UnsupportedModelError, match="do not stay independent"):
        model.load_weights(hf)


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# The generic model path on one GPU: fp32 greedy parity with stock for every architecture the
# CPU coverage test serves (Triton backend, decode CUDA graphs where the probe allows them), the
# CUDA-graph probe itself, and model_impl="generic" against native.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _engine(model, **kw):
    return LLM(model, max_model_len=128, kv_block_size=16, num_kv_blocks=64, **kw)


@pytest.mark.gpu
@needs_cuda
def test_graph_probe_llama_captures(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"))
    with _engine(path, model_impl="generic") as llm:
        runner = llm.engine.executor.runner
        assert runner.model.supports_cuda_graph, runner.model.cuda_graph_reason
        assert runner.graph_runner is not None


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gemma2", "gpt_oss"])
def test_graph_probe_decides_and_tokens_match(model_type):
    """Whatever the probe decides (MoE expert loops sync with the host), tokens equal stock's,
    with and without enforce_eager; the reason is kept when graphs are off."""
    _, hf = build_tiny(model_type)
    hf = hf.cuda()
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    outs = []
    for eager in (False, True):
        with _engine(hf, enforce_eager=eager) as llm:
            model = llm.engine.executor.runner.model
            if not model.supports_cuda_graph:
                assert model.cuda_graph_reason
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    assert outs[0] == outs[1] == parity.hf_greedy(hf, prompts, new_tokens=24)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_generic_equals_native_cuda(family, tmp_path):
    path = save_tiny_model(family, str(tmp_path / family))
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 60))]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    got = {}
    for impl in ("native", "generic"):
        with _engine(path, model_impl=impl) as llm:
            got[impl] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["generic"] == got["native"]
