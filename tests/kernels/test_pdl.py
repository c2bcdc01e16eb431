"""Host-side PDL switch (kernels/pdl.py): CPU tensors launch without PDL even when requested.

Programmatic dependent launch (kernels/pdl.py, on by default, ``HF_PAGED_PDL=0`` off) on
Hopper: every kernel gives the same bits launched with PDL (with and without the skinny GEMM's
first weight tile loaded before the wait) as without, eagerly and in CUDA-graph replay. That
the engine's greedy tokens do not change with PDL is tests/engine/test_engine_parity.py's.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged import envs
from hf_paged.kernels import pdl
from hf_paged.testing.markers import marked

# ---- on the host ----------------------------------------------------------------------------------


def test_cpu_tensors_launch_without_pdl(monkeypatch):
    monkeypatch.setattr(envs, "HF_PAGED_PDL", True)
    t = torch.zeros(2)
    assert not pdl.pdl_enabled(t)
    assert pdl.pdl_kwargs(t) == {"USE_PDL": False}


# ---- on CUDA --------------------------------------------------------------------------------------


_MARKS_PDL_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(
        torch.cuda.is_available() and not pdl._supported(torch.cuda.current_device()),
        reason="PDL needs compute capability 9.0+ and a Triton with launch_pdl",
    ),
]


def _chain(x, res, nw, w_qkv, w_down, gu, q, k_cache, v_cache, bt, ctx):
    """A decode layer's kernels back to back, each reading the one before's output: norm,
    skinny GEMM, paged decode (split-K + reduce), activation, skinny GEMM, argmax."""
    from hf_paged.kernels import fused_act, fused_norm
    from hf_paged.kernels.argmax import argmax
    from hf_paged.kernels.attention import paged_decode
    from hf_paged.kernels.skinny_gemm import skinny_gemm

    h, new_res = fused_norm.fused_add_rms_norm(x, res, nw, 1e-6)
    qkv = skinny_gemm(h, w_qkv)
    q = q + qkv[:, : q.shape[1] * q.shape[2]].view_as(q)
    o = paged_decode.paged_decode(q, k_cache, v_cache, bt, ctx, q.shape[-1] ** -0.5)
    gu = gu + o.reshape(o.shape[0], -1).repeat(1, gu.shape[1] // (o.shape[1] * o.shape[2]))
    act = fused_act.silu_and_mul(gu)
    y = skinny_gemm(act, w_down)
    return h, new_res, qkv, o, act, y, argmax(y)


def _inputs():
    g = torch.Generator(device="cuda").manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).bfloat16()

    num_blocks, bs, hkv, d = 64, 16, 8, 128
    return dict(
        x=r(2, 4096),
        res=r(2, 4096),
        nw=r(4096, scale=0.1) + 1,
        w_qkv=r(6144, 4096, scale=0.02),
        w_down=r(4096, 14336, scale=0.01),
        gu=r(2, 28672),
        q=r(2, 32, d),
        k_cache=r(num_blocks, bs, hkv, d),
        v_cache=r(num_blocks, bs, hkv, d),
        bt=torch.arange(96, device="cuda", dtype=torch.int32).view(2, 48) % num_blocks,
        ctx=torch.tensor([700, 33], device="cuda", dtype=torch.int32),
    )


@marked(_MARKS_PDL_KERNELS)
@pytest.mark.parametrize("prefetch", [False, True])
def test_kernels_same_bits_with_pdl_eager_and_graph(monkeypatch, prefetch):
    inp = _inputs()
    monkeypatch.setattr(envs, "HF_PAGED_PDL", False)
    ref = _chain(**inp)
    monkeypatch.setattr(envs, "HF_PAGED_PDL", True)
    monkeypatch.setattr(envs, "HF_PAGED_PDL_PREFETCH", prefetch)
    assert pdl.pdl_kwargs(inp["x"]) == {"USE_PDL": True, "launch_pdl": True}
    got = _chain(**inp)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _chain(**inp)
    for t in (inp["x"], inp["gu"]):
        t.copy_(t.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    monkeypatch.setattr(envs, "HF_PAGED_PDL", False)
    ref2 = _chain(**inp)
    for a, b in zip(ref2, out):
        assert torch.equal(a, b)
