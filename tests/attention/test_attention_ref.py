"""The torch reference backend against a dense naive attention: V head dim != K head dim, score
softcap, ALiBi, GQA, sliding window, prefill over a cached prefix, decode, and no cache at all. Plus the
Triton backend's ``problem`` report, which needs no triton."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention.base import AttentionLayerSpec
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.testing import build_metadata

BLOCK, MAX_BLOCKS = 4, 4


def naive(q, k, v, q_len, spec):
    """q [S, H, D], k [S, Hkv, D], v [S, Hkv, Dv] of one whole sequence -> its last ``q_len``
    queries' outputs [q_len, H, Dv]."""
    s, h, _ = q.shape
    g = h // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * spec.scale
    if spec.softcap is not None:
        scores = spec.softcap * torch.tanh(scores / spec.softcap)
    pos = torch.arange(s)
    if spec.alibi_slopes is not None:  # Bloom's form: slope * k_pos (the same softmax)
        scores = scores + torch.tensor(spec.alibi_slopes).double().view(-1, 1, 1) * pos.double()
    mask = pos[None, :] <= pos[:, None]
    if spec.sliding_window is not None:
        mask &= pos[:, None] - pos[None, :] < spec.sliding_window
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v.double())[s - q_len :].float()


SPECS = {
    "dv_smaller": AttentionLayerSpec(4, 2, 16, 0.3, head_dim_v=8),
    "dv_larger_softcap": AttentionLayerSpec(4, 1, 8, 0.5, head_dim_v=24, softcap=2.0),
    "softcap_window": AttentionLayerSpec(2, 2, 16, 0.4, sliding_window=3, softcap=1.5),
    "alibi_gqa": AttentionLayerSpec(4, 2, 16, 0.3, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)),
    "alibi_window": AttentionLayerSpec(2, 1, 8, 0.5, sliding_window=4, alibi_slopes=(1.0, 0.3)),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_ref_matches_naive_with_a_paged_cache(name):
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    lens = [9, 5, 13]
    h, hkv, d, dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    seqs = [
        (torch.randn(n, h, d, generator=g) * 2, torch.randn(n, hkv, d, generator=g) * 2,
         torch.randn(n, hkv, dv, generator=g))
        for n in lens
    ]  # fmt: skip
    num_blocks = len(lens) * MAX_BLOCKS
    k_cache = torch.zeros(num_blocks, BLOCK, hkv, d)
    v_cache = torch.zeros(num_blocks, BLOCK, hkv, dv)
    backend = TorchRefBackend()
    # step 1: a prefill chunk of each sequence but its last 3 tokens; step 2: 2 more tokens
    # over the cached prefix; step 3: a decode of the last token
    done = [0] * len(lens)
    for q_lens in ([n - 3 for n in lens], [2] * len(lens), [1] * len(lens)):
        ends = [a + b for a, b in zip(done, q_lens)]
        meta, _ = build_metadata(q_lens, ends, BLOCK, MAX_BLOCKS)
        # the new tokens of every sequence, concatenated: q [T, H, D], k [T, Hkv, D], v
        new = [
            torch.cat([seq[j][e - n : e] for seq, e, n in zip(seqs, ends, q_lens)])
            for j in range(3)
        ]
        out = backend.forward(*new, k_cache, v_cache, meta, spec)
        assert tuple(out.shape) == (sum(q_lens), h, dv)
        for i, (q, k, v) in enumerate(seqs):
            e, n = ends[i], q_lens[i]
            want = naive(q[:e], k[:e], v[:e], n, spec)
            got = out[meta.cu_seqlens_q_cpu[i] : meta.cu_seqlens_q_cpu[i + 1]]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        done = ends


def test_softcap_changes_the_output():
    """Guards the tests above: the softcap must matter on these inputs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 16, generator=g) * 3 for _ in range(3))
    capped = AttentionLayerSpec(2, 2, 16, 0.5, softcap=1.0)
    plain = AttentionLayerSpec(2, 2, 16, 0.5)
    assert not torch.allclose(naive(q, k, v, 6, capped), naive(q, k, v, 6, plain), atol=1e-2)


def test_alibi_changes_the_output():
    """Guards the ALiBi cases above: the bias must matter on these inputs."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(6, 2, 16, generator=g) for _ in range(3))
    biased = AttentionLayerSpec(2, 2, 16, 0.5, alibi_slopes=(1.0, 0.5))
    plain = AttentionLayerSpec(2, 2, 16, 0.5)
    assert not torch.allclose(naive(q, k, v, 6, biased), naive(q, k, v, 6, plain), atol=1e-2)


def test_no_cache_attends_whole_prompts_and_refuses_cached_tokens():
    spec = SPECS["dv_larger_softcap"]
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(7, 4, 8, generator=g), torch.randn(7, 1, 8, generator=g)
    v = torch.randn(7, 1, 24, generator=g)
    meta, _ = build_metadata([7], [7], BLOCK, MAX_BLOCKS)
    out = TorchRefBackend().forward(q, k, v, None, None, meta, spec)
    torch.testing.assert_close(out, naive(q, k, v, 7, spec), atol=1e-5, rtol=1e-5)
    meta, _ = build_metadata([2], [7], BLOCK, MAX_BLOCKS)
    with pytest.raises(ValueError, match="5 cached tokens but meta.kv_cache is None"):
        TorchRefBackend().forward(q[5:], k[5:], v[5:], None, None, meta, spec)


def test_triton_backend_reports_what_it_cannot_compute():
    from hf_paged.attention.triton_backend import TritonBackend

    b = TritonBackend()
    ok = AttentionLayerSpec(8, 2, 128, 0.1, sliding_window=64)
    assert b.problem(ok, torch.bfloat16, 16) is None
    for spec in (AttentionLayerSpec(8, 2, 128, 0.1, softcap=50.0),  # the generic path's specs
                 AttentionLayerSpec(8, 2, 192, 0.1, head_dim_v=128),
                 AttentionLayerSpec(8, 2, 80, 0.1, alibi_slopes=(0.5,) * 8)):  # fmt: skip
        assert b.problem(spec, torch.bfloat16, 16) is None, spec
    cases = {
        "head_dim=320": AttentionLayerSpec(8, 2, 320, 0.1),
        "head_dim_v=512": AttentionLayerSpec(8, 2, 128, 0.1, head_dim_v=512),
        "2 ALiBi slopes for num_heads=8": AttentionLayerSpec(8, 2, 64, 0.1, alibi_slopes=(1, 2)),
    }
    for reason, spec in cases.items():
        assert reason in b.problem(spec, torch.bfloat16, 16)
    assert "kv_block_size=4" in b.problem(ok, torch.bfloat16, 4)


def test_context_gives_unsupported_layers_the_torch_reference():
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.layers.attention import Attention
    from hf_paged.layers.context import ModelContext

    ctx = ModelContext(TritonBackend(), kv_block_size=16)
    fine = Attention(AttentionLayerSpec(4, 2, 64, 0.1), ctx, 0)
    wide = Attention(AttentionLayerSpec(4, 2, 512, 0.1), ctx, 1)
    assert fine.backend.name == "triton" and wide.backend.name == "torch"
    assert list(ctx.fallbacks) == [1] and "head_dim=512" in ctx.fallbacks[1]
    assert not ctx.supports_cuda_graph  # the torch reference cannot be captured
