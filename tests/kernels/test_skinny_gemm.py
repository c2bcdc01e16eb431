"""Skinny GEMM (decode-batch linear layers) on CUDA vs an fp32 reference and cuBLAS: bf16 and
fp16, 1..16 rows, the 8B/0.6B decode shapes and ragged ones, bias, strided weights, graph replay,
and the layer dispatch (few rows of a large weight -> kernel, else cuBLAS).

Skinny GEMM (decode-batch linear layers) vs ``F.linear`` under Triton's CPU interpreter, fp16:
row counts 1..16, N and K that are not multiples of the tiles, bias, a strided weight view.
Runs as a child process like tests/kernels/test_paged_attention.py; GPU cases (bf16, the real
shapes) are in tests/kernels/test_skinny_gemm.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_paged.testing.markers import marked
from tests.kernels.interpret_utils import interpret_main

# ---- on any device --------------------------------------------------------------------------------


_MARKS_SKINNY_GEMM = [
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


@marked(_MARKS_SKINNY_GEMM)
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


@marked(_MARKS_SKINNY_GEMM)
@pytest.mark.parametrize("m", [1, 7])
def test_bias_and_strided_weight(m):
    from hf_paged.kernels.skinny_gemm import skinny_gemm

    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(m, 512, generator=gen, device="cuda").bfloat16()
    big = torch.randn(300, 1024, generator=gen, device="cuda").bfloat16() * 0.05
    w = big[:, 256:768]  # row stride 1024
    b = torch.randn(300, generator=gen, device="cuda").bfloat16()
    _check(skinny_gemm(x, w, b), x, w, b, cublas_bits=False)


@marked(_MARKS_SKINNY_GEMM)
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


@marked(_MARKS_SKINNY_GEMM)
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


# ---- under Triton's CPU interpreter (the cases run in one child process) --------------------------


CASES = [  # (M, N, K, bias, config)
    (1, 64, 128, False, (16, 64, 4, 2)),
    (3, 40, 72, True, (16, 32, 4, 2)),  # N, K not multiples of the tiles
    (16, 48, 256, False, (32, 128, 4, 2)),
    (7, 33, 64, True, (16, 64, 4, 2)),
]


def _case(m, n, k, bias, config):
    import torch
    import torch.nn.functional as F

    from hf_paged.kernels.skinny_gemm import skinny_gemm

    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).half()
    big = torch.randn(n, k + 8, generator=gen).half()  # row stride k + 8: a strided view
    w = big[:, :k]
    b = torch.randn(n, generator=gen).half() if bias else None
    out = skinny_gemm(x, w, b, config=config)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.shape == (m, n) and out.dtype == torch.float16
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _cases():
    return {f"m{m}_n{n}_k{k}_b{int(b)}": (_case, (m, n, k, b, c)) for m, n, k, b, c in CASES}




@pytest.mark.parametrize("name", list(_cases()))
def test_skinny_gemm_matches_linear(interpreted, name):
    value = interpreted[name]
    assert value < 2e-3, f"{name}: relative error {value}"


def test_rejects_what_it_cannot_take():
    import torch

    from hf_paged.kernels.skinny_gemm import skinny_gemm

    x = torch.zeros(17, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        skinny_gemm(x, torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        skinny_gemm(torch.zeros(2, 64), torch.zeros(32, 64))
    with pytest.raises(ValueError, match="must be % 8"):
        skinny_gemm(
            torch.zeros(2, 60, dtype=torch.float16), torch.zeros(32, 60, dtype=torch.float16)
        )


if __name__ == "__main__":
    interpret_main(_cases())
