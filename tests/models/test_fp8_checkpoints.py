"""FP8 checkpoints served natively (native and generic paths, CPU, fp32): transformers'
fine-grained FP8 (quantized by transformers' own ``FineGrainedFP8Config`` quantizer, saved with
``save_pretrained``) and compressed-tensors FP8 (our writer: FP8-dynamic per-channel, FP8
static per-tensor).

transformers' own FP8 forward does not run on CPU (its ``FP8Linear`` needs the
``finegrained-fp8`` hub kernel, or DeepGEMM, both CUDA): the oracle here is transformers'
dequantized model (``FineGrainedFP8Config(dequantize=True)``, its ``Fp8Dequantize``) for the
fine-grained format and a stock model holding the dequantized weights for compressed-tensors.
On CPU the engine's FP8 layers run the dequantize-then-matmul reference, so prompt logprobs
agree to 1e-5 and greedy tokens are equal.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config

import hf_paged
from hf_paged import LLM, PagedFallbackWarning, SamplingParams
from hf_paged.kernels.fp8.fp8_gemm import dequantize_ref
from hf_paged.layers.quantization.fp8_checkpoints import (
    load_finegrained_fp8,
    save_compressed_tensors_fp8,
)
from hf_paged.testing import save_tiny_model

TOL = 1e-5
ENGINE = dict(max_model_len=96, kv_block_size=8, num_kv_blocks=64)
BLOCK = (32, 32)  # divides every projection of the tiny models (hidden 64, intermediate 128)


def prompts(n: int = 6, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(11)]  # a shared prefix: prefix-cache hits
    return [[rng.randrange(3, 256)]] + [
        shared + [rng.randrange(3, 256) for _ in range(rng.randint(1, 20))] for _ in range(n)
    ]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """family -> plain fp32 checkpoint directory."""
    root = tmp_path_factory.mktemp("fp8_plain")
    return {f: save_tiny_model(f, str(root / f), seed=3) for f in ("llama", "qwen3", "qwen2")}


@pytest.fixture(scope="module")
def finegrained(plain, tmp_path_factory):
    """family -> (fine-grained FP8 checkpoint dir, transformers' dequantized model of it)."""
    out = {}
    for family, path in plain.items():
        model = load_finegrained_fp8(path, BLOCK, dtype=torch.float32)
        dst = str(tmp_path_factory.mktemp(f"fp8_{family}"))
        model.save_pretrained(dst)
        ref = AutoModelForCausalLM.from_pretrained(
            dst, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
        ).eval()
        out[family] = (dst, ref)
    return out


def hf_scores(hf, prompt: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


def hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                          do_sample=False, pad_token_id=0)  # fmt: skip
    return seq[0, len(prompt) :].tolist()


def check_against(source, ref, model_impl: str) -> dict:
    """Prompt logprobs to TOL and 16 greedy tokens equal to ``ref``; returns engine stats and
    the engine's linear weight dtypes."""
    ps = prompts()
    scored = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)  # both stop at EOS
    with LLM(source, model_impl=model_impl, **ENGINE) as llm:
        scores = llm.generate(ps, scored, use_tqdm=False)
        outs = llm.generate(ps, greedy, use_tqdm=False)  # batched, over a shared prefix
        stats = dict(llm.stats)
        model = llm.engine.executor.runner.model
        dtypes = {n: p.dtype for n, p in model.named_parameters()}
    for p, s, o in zip(ps, scores, outs):
        lp = hf_scores(ref, p)
        for i in range(1, len(p)):
            want = lp[i - 1, p[i]].item()
            assert abs(s.prompt_logprobs[i].logprob - want) < TOL * max(1.0, abs(want)), (p, i)
        assert o.token_ids == hf_greedy(ref, p, 16)
    return {"stats": stats, "dtypes": dtypes}


@pytest.mark.parametrize("model_impl", ["native", "generic"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen2"])
def test_finegrained_checkpoint_matches_dequantized_hf(finegrained, family, model_impl):
    path, ref = finegrained[family]
    got = check_against(path, ref, model_impl)
    fp8 = [n for n, d in got["dtypes"].items() if d == torch.float8_e4m3fn]
    scales = [n for n in got["dtypes"] if n.endswith("weight_scale_inv")]
    # every decoder projection stays float8 in memory (7 per layer on the generic path: q, k, v,
    # o, gate, up, down; 4 fused ones natively), with its block scales; the head stays plain
    per_layer = 7 if model_impl == "generic" else 4
    assert len(fp8) == len(scales) == 2 * per_layer
    assert not any("lm_head" in n or "embed" in n for n in fp8)
    assert got["stats"]["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("model_impl", ["native", "generic"])
@pytest.mark.parametrize(
    "strategy,dynamic", [("channel", True), ("tensor", False)], ids=["fp8_dynamic", "fp8_static"]
)
def test_compressed_tensors_checkpoint_matches_dequantized(
    plain, tmp_path, strategy, dynamic, model_impl
):
    base = AutoModelForCausalLM.from_pretrained(plain["llama"], dtype=torch.float32).eval()
    scales = {n: 0.5 + 0.01 * i for i, (n, _) in enumerate(base.named_modules())}
    dequantized = save_compressed_tensors_fp8(base, tmp_path, strategy, dynamic,
                                              input_scales=scales)  # fmt: skip
    with torch.no_grad():  # the oracle: stock modules holding exactly the dequantized weights
        for name, w in dequantized.items():
            base.get_parameter(name).copy_(w)
    got = check_against(str(tmp_path), base, model_impl)
    fp8 = [n for n, d in got["dtypes"].items() if d == torch.float8_e4m3fn]
    assert fp8 and all(n.replace("weight", "weight_scale") in got["dtypes"] for n in fp8)
    if not dynamic:  # a static input scale loads (the reference GEMM does not use it)
        assert any(n.endswith("input_scale") for n in got["dtypes"])


def test_dequantize_ref_equals_transformers_dequantization(finegrained, plain):
    """Our reference dequantization (what the CPU layers compute with) is transformers' own
    ``Fp8Dequantize``, bit for bit, and the in-memory weights stay float8."""
    fp8 = load_finegrained_fp8(plain["llama"], BLOCK, dtype=torch.float32)
    _, ref = finegrained["llama"]
    n = 0
    for name, module in fp8.named_modules():
        if type(module).__name__ != "FP8Linear":
            continue
        assert module.weight.dtype == torch.float8_e4m3fn
        ours = dequantize_ref(module.weight, module.weight_scale_inv, BLOCK, torch.float32)
        assert torch.equal(ours, ref.get_submodule(name).weight), name
        n += 1
    assert n == 14


def test_generate_paged_on_in_memory_finegrained_model(plain, finegrained):
    """``generate(backend="paged")`` serves a model quantized in memory with
    ``FineGrainedFP8Config`` (no fallback) with stock's outputs: transformers' own FP8 forward
    does not run on CPU, so stock is its dequantized model here."""
    hf_paged.install()
    model = load_finegrained_fp8(plain["qwen3"], BLOCK, dtype=torch.float32)
    _, ref = finegrained["qwen3"]
    ids = torch.tensor([[5, 9, 33, 7, 250, 12], [0, 0, 41, 42, 43, 44]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                  pad_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)  # a fallback fails the test
        paged = model.generate(**kwargs, backend="paged", paged_config=dict(ENGINE))
    with torch.no_grad():
        stock = ref.generate(**kwargs)
    assert torch.equal(paged, stock)
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn


def test_in_memory_model_shares_the_float8_weights(plain):
    """Unfused FP8 weights of an in-memory model are used in place (no second copy)."""
    model = load_finegrained_fp8(plain["llama"], BLOCK, dtype=torch.float32)
    with LLM(model, **ENGINE) as llm:
        ours = llm.engine.executor.runner.model.model.layers[0].self_attn.o_proj
        theirs = model.model.layers[0].self_attn.o_proj
        assert ours.weight.data_ptr() == theirs.weight.data_ptr()
        assert ours.weight_scale_inv.data_ptr() == theirs.weight_scale_inv.data_ptr()


def test_checkpoint_with_plain_weights_under_an_fp8_config_is_refused(plain, tmp_path):
    """A config that names FP8 over a checkpoint of plain weights fails loudly, naming it."""
    import json
    import shutil

    shutil.copytree(plain["llama"], tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="float32 but the quantization_config makes this layer"):
        LLM(str(tmp_path), **ENGINE)


def _dequantized_hf(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FineGrainedFP8Config(dequantize=True), dtype=torch.float32
    ).eval()


def test_per_tensor_static_finegrained_checkpoint(plain, tmp_path):
    """transformers' per-tensor format (``weight_block_size`` null, static activations): its
    ``[1, 1]`` weight scales and 0-dim ``activation_scale`` tensors load natively."""
    model = load_finegrained_fp8(plain["llama"], None, dtype=torch.float32,
                                 activation_scheme="static")  # fmt: skip
    with torch.no_grad():  # transformers' quantizer leaves them unset
        for name, p in model.named_parameters():
            if name.endswith("activation_scale"):
                p.fill_(0.05)
    model.save_pretrained(tmp_path)
    got = check_against(str(tmp_path), _dequantized_hf(tmp_path), "native")
    assert any(n.endswith("qkv_proj.activation_scale") for n in got["dtypes"])


def _save_blocks(plain_path: str, dst, block: tuple[int, int]) -> torch.nn.Module:
    """A fine-grained FP8 checkpoint whose blocks need not divide the weights (the last block of
    a dimension partial, scales ``[ceil(N / bn), ceil(K / bk)]``), as DeepSeek's are written;
    returns the stock model holding the dequantized weights."""
    from safetensors.torch import save_file

    model = AutoModelForCausalLM.from_pretrained(plain_path, dtype=torch.float32).eval()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    bn, bk = block
    for name, module in model.named_modules():
        if type(module) is not torch.nn.Linear or name == "lm_head":
            continue
        w = module.weight.data
        n, k = w.shape
        amax = torch.nn.functional.pad(w.abs(), (0, -k % bk, 0, -n % bn))
        amax = amax.view(-(-n // bn), bn, -(-k // bk), bk).amax(dim=(1, 3))
        scale = amax / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w / full).clamp(-448, 448).to(torch.float8_e4m3fn)
        state[f"{name}.weight"], state[f"{name}.weight_scale_inv"] = q, scale
        w.copy_(q.float() * full)
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": list(block),
                                        "activation_scheme": "dynamic"}  # fmt: skip
    model.config.save_pretrained(dst)
    del model.config.quantization_config
    return model


@pytest.mark.parametrize("case", ["block_spans_shards", "partly_fp8", "fp8_head"])
def test_checkpoints_the_fused_native_layers_cannot_hold_take_the_generic_path(
    plain, tmp_path, case
):
    """A block spanning two fused shards (64-row blocks over 32-row k and v), fused modules
    partly left plain, an FP8 output head: the native decoder refuses them by name and
    ``model_impl="auto"`` serves them through HF's unfused modules, with stock's outputs."""
    if case == "block_spans_shards":
        ref = _save_blocks(plain["llama"], tmp_path, (64, 64))
    else:
        skip = ["lm_head", "k_proj"] if case == "partly_fp8" else []
        load_finegrained_fp8(plain["llama"], BLOCK, dtype=torch.float32,
                             modules_to_not_convert=skip).save_pretrained(tmp_path)  # fmt: skip
        ref = _dequantized_hf(tmp_path)
    got = check_against(str(tmp_path), ref, "auto")
    assert any(n.endswith("self_attn.q_proj.weight") for n in got["dtypes"])  # unfused: generic
    if case == "block_spans_shards":
        with pytest.raises(ValueError, match=r"weight_block_size\[0\]=64.*model_impl='generic'"):
            LLM(str(tmp_path), model_impl="native", **ENGINE)


def _stock_semantics(model) -> torch.nn.Module:
    """A plain copy of an in-memory transformers FP8 model computing what its ``FP8Linear``
    modules compute: float8 weights dequantized, plain ones (left unquantized, or tied to the
    embeddings) as they are."""
    config = model.config.__class__.from_dict(model.config.to_dict())
    del config.quantization_config
    ref = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    state = {}
    for name, module in model.named_modules():
        w = module._parameters.get("weight")
        if w is not None and w.dtype == torch.float8_e4m3fn:
            w = dequantize_ref(w, module.weight_scale_inv, module.block_size, torch.float32)
        if w is not None:
            state[f"{name}.weight"] = w
    state.update({n: p for n, p in model.named_parameters() if n.endswith("bias")})
    ref.load_state_dict(state, strict=False)
    ref.tie_weights()
    return ref


@pytest.mark.parametrize("family,block,skip", [("llama", (64, 64), None), ("qwen3", BLOCK, [])],
                         ids=["unquantized_kv", "tied_fp8_head"])  # fmt: skip
def test_in_memory_fp8_linears_holding_plain_weights(plain, family, block, skip):
    """transformers' quantizer leaves a weight its blocks do not divide (k/v: 32 rows, blocks of
    64) unquantized in its ``FP8Linear``, and a head tied to the embeddings holds the plain
    table: those compute plainly, scales unused; ``generate(backend="paged")`` matches."""
    hf_paged.install()
    kw = {} if skip is None else {"modules_to_not_convert": skip}
    model = load_finegrained_fp8(plain[family], block, dtype=torch.float32, **kw)
    assert any(m.weight.dtype == torch.float32 for m in model.modules()
               if type(m).__name__ == "FP8Linear")  # fmt: skip
    ids = torch.tensor([[5, 9, 33, 7, 250, 12], [0, 0, 41, 42, 43, 44]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                  pad_token_id=0)  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = model.generate(**kwargs, backend="paged", paged_config=dict(ENGINE))
    with torch.no_grad():
        stock = _stock_semantics(model).generate(**kwargs)
    assert torch.equal(paged, stock)


def test_tied_checkpoint_with_an_fp8_head_config(plain, tmp_path):
    """``modules_to_not_convert=[]`` on a model with tied embeddings: the checkpoint stores the
    head's scale but no head weight; the head is the plain embedding table (stock, which
    dequantizes on CPU, computes it so) and the native path serves it."""
    load_finegrained_fp8(plain["qwen3"], BLOCK, dtype=torch.float32,
                         modules_to_not_convert=[]).save_pretrained(tmp_path)  # fmt: skip
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    got = check_against(str(tmp_path), stock, "auto")
    assert any(n.endswith("qkv_proj.weight") for n in got["dtypes"])  # native
