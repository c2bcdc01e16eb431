"""Skinny GEMM (decode-batch linear layers) on CUDA vs an fp32 reference and cuBLAS: bf16 and
fp16, 1..16 rows, the 8B/0.6B decode shapes and ragged ones, bias, strided weights, graph replay,
and the layer dispatch (few rows of a large weight -> kernel, else cuBLAS)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPES = [(6144, 4096), (4096, 14336), (1024, 3072), (1000, 72), (151936, 1024)]  # (N, K)


def _check(out, x, w, b, cublas_bits=True):
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    assert out.shape == ref.shape and out.dtype == x.dtype
    # fp32 accumulation on both sides; the output rounds once: within 1 ulp of the output dtype
    ulp = 2**-7 if x.dtype == torch.bfloat16 else 2**-10
    err = (out.float() - ref).abs()
    assert (err <= ulp * ref.abs() + 1e-3 * ref.abs().max()).all(), err.max().item()
    if cublas_bits:  # no bias: mostly the same bits as cuBLAS (it rounds a bias differently)
        assert (out == F.linear(x, w, b)).float().mean().item() > 0.9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 16])
@pytest.mark.parametrize("nk", SHAPES)
def test_matches_reference(dtype, m, nk):
    from hf_paged.kernels.skinny_gemm import skinny_gemm

    n, k = nk
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    _check(skinny_gemm(x, w), x, w, None)


@pytest.mark.parametrize("m", [1, 7])
def test_bias_and_strided_weight(m):
    from hf_paged.kernels.skinny_gemm import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, 512, generator=gen, device="cuda").bfloat16()
    big = torch.randn(300, 1024, generator=gen, device="cuda").bfloat16() * 0.05
    w = big[:, 256:768]  # row stride 1024
    b = torch.randn(300, generator=gen, device="cuda").bfloat16()
    _check(skinny_gemm(x, w, b), x, w, b, cublas_bits=False)


def test_graph_replay_on_new_data():
    from hf_paged.kernels.skinny_gemm import skinny_gemm

    x = torch.randn(4, 1024, device="cuda").bfloat16()
    w = torch.randn(2048, 1024, device="cuda").bfloat16() * 0.03
    out = skinny_gemm(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_gemm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    _check(out, x, w, None)


def test_layers_dispatch_by_row_count():
    from hf_paged.kernels import skinny_gemm as sg

    w = torch.randn(4096, 4096, device="cuda").bfloat16() * 0.02  # large enough to dispatch
    small = torch.randn(1024, 1024, device="cuda").bfloat16()
    calls = []
    real = sg.skinny_gemm
    sg.skinny_gemm = lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw)
    try:
        for m in (1, 4, 5, 64):
            x = torch.randn(m, 4096, device="cuda").bfloat16()
            _check(sg.linear(x, w), x, w, None)
        sg.linear(torch.randn(2, 4096, device="cuda"), w.float())  # fp32: cuBLAS
        sg.linear(torch.randn(1, 1024, device="cuda").bfloat16(), small)  # small: cuBLAS
        bias = torch.zeros(4096, device="cuda").bfloat16()
        sg.linear(torch.randn(1, 4096, device="cuda").bfloat16(), w, bias)  # bias: cuBLAS
    finally:
        sg.skinny_gemm = real
    assert calls == [1, 4]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 4, 16])
@pytest.mark.parametrize("nk", [(4096, 14336), (1000, 72)])
def test_silu_prologue_is_the_unfused_bits(dtype, m, nk):
    """silu_mul_gemm == fused silu_and_mul, then skinny_gemm: the same bits."""
    from hf_paged.kernels.fused_act import silu_and_mul
    from hf_paged.kernels.skinny_gemm import silu_mul_gemm, skinny_gemm

    n, k = nk
    gen = torch.Generator(device="cuda").manual_seed(m)
    gate_up = (torch.randn(m, 2 * k, generator=gen, device="cuda") * 2).to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    assert torch.equal(silu_mul_gemm(gate_up, w), skinny_gemm(silu_and_mul(gate_up), w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 4, 9])
@pytest.mark.parametrize("nk", [(6144, 4096), (28672, 4096), (1000, 72), (512, 8192)])
@pytest.mark.parametrize("residual", [False, True])
def test_norm_prologue_matches_norm_then_gemm(dtype, m, nk, residual):
    """rms_norm_gemm vs the fused RMSNorm kernel then skinny_gemm: the new residual is the same
    bits; the output within an ulp of the fp32 product of the unfused norm (only the fp32 sum of
    squares differs in order) and mostly the same bits."""
    from hf_paged.kernels import fused_norm
    from hf_paged.kernels.skinny_gemm import rms_norm_gemm, skinny_gemm

    n, k = nk
    gen = torch.Generator(device="cuda").manual_seed(m + k)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 3).to(dtype)
    res = (torch.randn(m, k, generator=gen, device="cuda") * 3).to(dtype) if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen, device="cuda")).to(dtype)
    w = (torch.randn(n, k, generator=gen, device="cuda") * k**-0.5).to(dtype)
    out, new_res = rms_norm_gemm(x, res, nw, 1e-5, w)
    if residual:
        h, ref_res = fused_norm.fused_add_rms_norm(x, res, nw, 1e-5)
        assert torch.equal(new_res, ref_res)
    else:
        h = fused_norm.rms_norm(x, nw, 1e-5)
        assert new_res is None
    _check(out, h, w, None, cublas_bits=False)
    assert (out == skinny_gemm(h, w)).float().mean().item() > 0.9


def test_prologues_replay_in_a_graph():
    from hf_paged.kernels import fused_act, fused_norm
    from hf_paged.kernels.skinny_gemm import rms_norm_gemm, silu_mul_gemm

    x = torch.randn(2, 4096, device="cuda").bfloat16()
    res = torch.randn(2, 4096, device="cuda").bfloat16()
    nw = torch.rand(4096, device="cuda").bfloat16() + 0.5
    gu = torch.randn(2, 2 * 4096, device="cuda").bfloat16()
    w = torch.randn(6144, 4096, device="cuda").bfloat16() * 0.02
    rms_norm_gemm(x, res, nw, 1e-6, w), silu_mul_gemm(gu, w)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (y1, new_res), y2 = rms_norm_gemm(x, res, nw, 1e-6, w), silu_mul_gemm(gu, w)
    for t in (x, res, gu):
        t.copy_(torch.randn_like(t))
    graph.replay()
    torch.cuda.synchronize()
    h, ref_res = fused_norm.fused_add_rms_norm(x, res, nw, 1e-6)
    assert torch.equal(new_res, ref_res)
    _check(y1, h, w, None, cublas_bits=False)
    _check(y2, fused_act.silu_and_mul(gu), w, None)


def test_layers_fuse_the_norm_and_the_activation_at_decode_batch_sizes():
    """RMSNorm.then_linear and RowParallelLinear(silu_gated=True) take the fused kernels for a
    few rows and the unfused path (norm/activation kernel, then cuBLAS) for many: same values."""
    from hf_paged.kernels import fused_act, fused_norm
    from hf_paged.kernels import skinny_gemm as sg
    from hf_paged.layers.layernorm import RMSNorm
    from hf_paged.layers.linear import ReplicatedLinear, RowParallelLinear

    torch.manual_seed(0)
    with torch.device("cuda"):
        norm = RMSNorm(4096, eps=1e-6).bfloat16()
        proj = ReplicatedLinear(4096, 6144, bias=False).bfloat16()
        down = RowParallelLinear(14336, 4096, bias=False).bfloat16()
    norm.weight.data.uniform_(0.5, 1.5)
    proj.weight.data.normal_(0, 0.02)
    down.weight.data.normal_(0, 0.01)
    calls = []
    real = sg.rms_norm_gemm, sg.silu_mul_gemm
    sg.rms_norm_gemm = lambda *a, **kw: calls.append("norm") or real[0](*a, **kw)
    sg.silu_mul_gemm = lambda *a, **kw: calls.append("silu") or real[1](*a, **kw)
    import hf_paged.layers.layernorm as ln

    ln_real = ln.rms_norm_gemm
    ln.rms_norm_gemm = sg.rms_norm_gemm
    try:
        for m in (1, 4, 5, 32):
            x = torch.randn(m, 4096, device="cuda").bfloat16()
            res = torch.randn(m, 4096, device="cuda").bfloat16()
            y, new_res = norm.then_linear(proj, x, res)
            h, ref_res = fused_norm.fused_add_rms_norm(x, res, norm.weight, 1e-6)
            assert torch.equal(new_res, ref_res)
            _check(y, h, proj.weight, None, cublas_bits=False)
            y0, same = norm.then_linear(proj, x)  # first layer: the residual is the input
            assert same is x
            _check(y0, fused_norm.rms_norm(x, norm.weight, 1e-6), proj.weight, None, False)
            gu = torch.randn(m, 2 * 14336, device="cuda").bfloat16()
            _check(down(gu, silu_gated=True), fused_act.silu_and_mul(gu), down.weight, None)
    finally:
        sg.rms_norm_gemm, sg.silu_mul_gemm = real
        ln.rms_norm_gemm = ln_real
    assert calls == ["norm", "norm", "silu"] * 2  # m = 1 and 4 only
