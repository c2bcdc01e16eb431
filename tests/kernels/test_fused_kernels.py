"""Fused RMSNorm / q-k norm + rope / silu_and_mul kernels vs their torch references on CUDA.

The references run on the same device (torch's CUDA ops), so in bf16/fp16 the kernels should give
the same bits for nearly every element (they round where torch rounds); the rare flip comes from
fp32 summation order, rsqrt/exp/div approximations. fp32 gets a tight tolerance instead (FMA
contraction). Also: the layers dispatch to the kernels on CUDA, and the kernels replay in a CUDA
graph on new data.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float16: 2**-10, torch.bfloat16: 2**-7}  # ~1 ulp relative
NUM_TOKENS = [1, 7, 256, 1000]
MIN_BIT_EQUAL = 0.99  # bf16/fp16: fraction of elements that must match the reference exactly


def _randn(*shape, dtype, seed=0, scale=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen, device="cuda")).to(dtype)


def _cos_sin(num_tokens, head_dim, dtype):
    """Rotary tables as RotaryEmbedding builds them, for spread-out positions."""
    from hf_paged.layers.rotary import default_inv_freq

    pos = torch.arange(num_tokens, device="cuda", dtype=torch.float32) * 37.0
    freqs = pos[:, None] * default_inv_freq(1e6, head_dim).cuda()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, out.dtype, ref.dtype)
    assert torch.isfinite(out).all(), "non-finite output"
    tol = TOL[ref.dtype]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)
    if ref.dtype != torch.float32:
        equal = (out == ref).float().mean().item()
        assert equal >= MIN_BIT_EQUAL, f"only {equal:.4f} of the elements are bit-equal"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 1024, 2048, 4096, 8192])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_rms_norm(dtype, hidden, num_tokens):
    from hf_paged.kernels.fused_norm import rms_norm, rms_norm_ref

    x = _randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    w = _randn(hidden, dtype=dtype, seed=2)
    _assert_matches(rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 100, 1024, 2048, 4096, 8192])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_fused_add_rms_norm(dtype, hidden, num_tokens):
    from hf_paged.kernels.fused_norm import fused_add_rms_norm, fused_add_rms_norm_ref

    x = _randn(num_tokens, hidden, dtype=dtype, seed=1, scale=3.0)
    r = _randn(num_tokens, hidden, dtype=dtype, seed=3, scale=10.0)
    w = _randn(hidden, dtype=dtype, seed=2)
    x0, r0 = x.clone(), r.clone()
    out, new_r = fused_add_rms_norm(x, r, w, 1e-6)
    ref, ref_r = fused_add_rms_norm_ref(x, r, w, 1e-6)
    _assert_matches(out, ref)
    _assert_matches(new_r, ref_r)
    assert torch.equal(x, x0) and torch.equal(r, r0), "inputs were modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
@pytest.mark.parametrize("heads", [(16, 8), (32, 4), (8, 1), (40, 40)])
@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope(dtype, head_dim, num_tokens, heads, norm):
    from hf_paged.kernels.fused_rope import qk_norm_rope, qk_norm_rope_ref

    num_heads, num_kv_heads = heads
    # q, k as strided views of a fused qkv projection, like the model hands them over
    qkv = _randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, scale=2.0)
    q = qkv[:, : num_heads * head_dim].view(num_tokens, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim : (num_heads + num_kv_heads) * head_dim]
    k = k.view(num_tokens, num_kv_heads, head_dim)
    cos, sin = _cos_sin(num_tokens, head_dim, dtype)
    weights = (None, None)
    if norm:
        weights = (_randn(head_dim, dtype=dtype, seed=7), _randn(head_dim, dtype=dtype, seed=8))
    before = qkv.clone()
    out_q, out_k = qk_norm_rope(q, k, cos, sin, *weights, eps=1e-6)
    ref_q, ref_k = qk_norm_rope_ref(q, k, cos, sin, *weights, eps=1e-6)
    _assert_matches(out_q, ref_q)
    _assert_matches(out_k, ref_k)
    assert out_q.is_contiguous() and out_k.is_contiguous()
    assert torch.equal(qkv, before), "inputs were modified"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 1000, 3072, 14336])
@pytest.mark.parametrize("num_tokens", NUM_TOKENS)
def test_silu_and_mul(dtype, inter, num_tokens):
    from hf_paged.kernels.fused_act import silu_and_mul, silu_and_mul_ref

    x = _randn(num_tokens, 2 * inter, dtype=dtype, seed=9, scale=3.0)
    _assert_matches(silu_and_mul(x), silu_and_mul_ref(x))


def test_layers_dispatch_to_kernels():
    """On CUDA the layers give the kernels' outputs (and those match the torch path)."""
    from hf_paged.kernels import fused_act, fused_norm, fused_rope
    from hf_paged.layers.activation import SiluAndMul
    from hf_paged.layers.layernorm import RMSNorm
    from hf_paged.layers.rotary import apply_rotary_emb_qk

    dtype, hidden, head_dim = torch.bfloat16, 1024, 128
    norm = RMSNorm(hidden, eps=1e-6).to("cuda", dtype)
    norm.weight.data.copy_(_randn(hidden, dtype=dtype, seed=2))
    x = _randn(7, hidden, dtype=dtype, seed=1)
    r = _randn(7, hidden, dtype=dtype, seed=3)
    assert torch.equal(norm(x), fused_norm.rms_norm(x, norm.weight, 1e-6))
    for got, want in zip(norm(x, r), fused_norm.fused_add_rms_norm(x, r, norm.weight, 1e-6)):
        assert torch.equal(got, want)
    gate_up = _randn(7, 2 * 3072, dtype=dtype, seed=4)
    assert torch.equal(SiluAndMul()(gate_up), fused_act.silu_and_mul(gate_up))

    q_norm, k_norm = (RMSNorm(head_dim, eps=1e-6).to("cuda", dtype) for _ in range(2))
    q_norm.weight.data.copy_(_randn(head_dim, dtype=dtype, seed=5))
    k_norm.weight.data.copy_(_randn(head_dim, dtype=dtype, seed=6))
    q, k = _randn(7, 16, head_dim, dtype=dtype, seed=7), _randn(7, 8, head_dim, dtype=dtype)
    cos, sin = _cos_sin(7, head_dim, dtype)
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin, q_norm, k_norm)
    want = fused_rope.qk_norm_rope(q, k, cos, sin, q_norm.weight, k_norm.weight, 1e-6)
    assert not stored and all(torch.equal(a, b) for a, b in zip(got, want))
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin)
    want = fused_rope.qk_norm_rope(q, k, cos, sin)
    assert not stored and all(torch.equal(a, b) for a, b in zip(got, want))
    # with a cache to write: the rotated k and v land in it, as store_kvcache would put them
    from hf_paged.kernels.attention.kv_store import store_kvcache

    v = _randn(7, 8, head_dim, dtype=dtype, seed=9)
    caches = [torch.zeros(4, 16, 8, head_dim, dtype=dtype, device="cuda") for _ in range(4)]
    slots = torch.tensor([3, -1, 17, 40, 63, -1, 0], device="cuda")
    *got, stored = apply_rotary_emb_qk(q, k, cos, sin, kv_cache=(v, caches[0], caches[1], slots))
    assert stored and all(torch.equal(a, b) for a, b in zip(got, want))
    store_kvcache(want[1], v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@torch.inference_mode()
def test_kernels_replay_in_cuda_graph():
    """A decode-shaped chain of all four kernels, captured once, replayed on new inputs."""
    from hf_paged.kernels import fused_act, fused_norm, fused_rope

    dtype, num_tokens, hidden, heads, head_dim = torch.bfloat16, 8, 1024, (16, 8), 128
    w = _randn(hidden, dtype=dtype, seed=1)
    qw, kw = _randn(head_dim, dtype=dtype, seed=2), _randn(head_dim, dtype=dtype, seed=3)
    static = {
        "x": torch.zeros(num_tokens, hidden, dtype=dtype, device="cuda"),
        "r": torch.zeros(num_tokens, hidden, dtype=dtype, device="cuda"),
        "qk": torch.zeros(num_tokens, sum(heads), head_dim, dtype=dtype, device="cuda"),
        "cos": torch.zeros(num_tokens, head_dim, dtype=dtype, device="cuda"),
        "sin": torch.zeros(num_tokens, head_dim, dtype=dtype, device="cuda"),
    }

    def step(fused: bool, t: dict):
        norm, add_norm, rope, act = (
            (fused_norm.rms_norm, fused_norm.fused_add_rms_norm, fused_rope.qk_norm_rope,
             fused_act.silu_and_mul) if fused else
            (fused_norm.rms_norm_ref, fused_norm.fused_add_rms_norm_ref,
             fused_rope.qk_norm_rope_ref, fused_act.silu_and_mul_ref)
        )  # fmt: skip
        h = norm(t["x"], w, 1e-6)
        h, res = add_norm(h, t["r"], w, 1e-6)
        q, k = rope(t["qk"][:, : heads[0]], t["qk"][:, heads[0] :], t["cos"], t["sin"], qw, kw,
                    1e-6)  # fmt: skip
        return act(torch.cat((h, res), dim=-1)), res, q, k

    step(True, static)  # warm up: compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step(True, static)
    for seed in range(3):
        new = {
            "x": _randn(num_tokens, hidden, dtype=dtype, seed=10 + seed),
            "r": _randn(num_tokens, hidden, dtype=dtype, seed=20 + seed),
            "qk": _randn(num_tokens, sum(heads), head_dim, dtype=dtype, seed=30 + seed),
        }
        new["cos"], new["sin"] = _cos_sin(num_tokens, head_dim, dtype)
        for name, t in new.items():
            static[name].copy_(t)
        graph.replay()
        for got, want in zip(outs, step(False, new)):
            _assert_matches(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128256), (4, 151936), (256, 151936), (3, 4097), (2, 1)])
def test_argmax_matches_torch(dtype, shape):
    from hf_paged.kernels.argmax import argmax

    b, v = shape
    x = _randn(b, v, dtype=dtype, seed=v)
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    # bf16 logits tie often: the maximum repeated, the first index wins
    x[:, v // 2] = 30.0
    x[:, v - 1] = 30.0
    x[:, min(5, v - 1)] = 30.0
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    x[b - 1, v - 1] = float("nan")  # NaN beats everything
    x[0, :] = float("-inf")
    assert torch.equal(argmax(x), x.argmax(dim=-1))
    rows = x[:, : max(v - 1, 1)]  # a strided view
    assert torch.equal(argmax(rows), rows.argmax(dim=-1))


def test_argmax_replays_in_a_graph():
    from hf_paged.kernels.argmax import argmax

    x = _randn(8, 128256, dtype=torch.bfloat16)
    argmax(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = argmax(x)
    x.copy_(_randn(8, 128256, dtype=torch.bfloat16, seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, x.argmax(dim=-1))
