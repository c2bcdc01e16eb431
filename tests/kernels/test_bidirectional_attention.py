"""The Triton paged prefill kernel with bidirectional ranges (Gemma 3's images) vs the torch
reference backend's mask (``attention/torch_ref.py``), which is checked against stock's own masks
in tests/attention/test_bidirectional_ranges.py.

Cases run under Triton's CPU interpreter in a child process (fp32; see interpret_utils.py), and
the same cases on a CUDA device in fp32 / bf16 (marked ``gpu``). They cover ranges on KV-block
and key-tile edges, ranges that began before the chunk (their head in the prefix cache), sliding
windows shorter than a range, GQA groups of 1 to 8 (and 3), and sequences without ranges beside
ones with them.
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main, random_paged_kv

TOL = 1e-4  # fp32 under the interpreter
GPU_TOL = {"float32": 1e-5, "bfloat16": 1e-2}  # relative Frobenius error on the GPU

# (q_len, context_len, ranges) per sequence; block size 16, key tiles of 32 (fp32 config)
EDGE_SEQS = [
    (48, 48, [(16, 32), (32, 48)]),  # ranges on block edges, back to back, the last at ctx
    (40, 40, [(0, 16), (15 + 16, 33)]),  # a range at position 0; one across a block edge
    (1, 1, [(0, 1)]),  # one-token prompt inside a one-token range
    (33, 33, []),  # a causal sequence beside the others
    (70, 70, [(3, 67)]),  # a range over three key tiles: the diagonal run past the rows' block
]
CHUNK_SEQS = [
    (30, 70, [(33, 60)]),  # the chunk starts inside the range (its head is cached)
    (20, 52, [(16, 48), (50, 52)]),  # chunk from 32: inside a range; a range at the end
    (17, 64, [(10, 20), (47, 64)]),  # a range wholly cached, and one that starts the chunk
    (5, 37, []),
]


def _batch(seqs, group, num_kv_heads=2, head_dim=32, block_size=16, seed=0,
           device="cpu", dtype="float32"):  # fmt: skip
    """Random paged batch with shuffled block ids (block_tables padded with 0)."""
    import torch

    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = random_paged_kv(
        [ctx for _, ctx, _ in seqs], num_kv_heads, head_dim, block_size, gen
    )
    k_cache, v_cache = k_cache.to(device, dt), v_cache.to(device, dt)
    cu = [0]
    for q_len, _, _ in seqs:
        cu.append(cu[-1] + q_len)
    q = torch.randn(cu[-1], group * num_kv_heads, head_dim, generator=gen).to(device, dt)
    return q, k_cache, v_cache, block_tables.to(device), cu, [c for _, c, _ in seqs]


def _reference(q, k_cache, v_cache, block_tables, cu, ctx, ranges, window, scale):
    """Per sequence: gather its keys, mask with the torch reference's ``causal_mask``, attend
    in fp32."""
    from hf_paged.attention.torch_ref import attend, causal_mask, gather_kv

    group = q.shape[1] // k_cache.shape[2]
    out = q.new_zeros(*q.shape[:2], v_cache.shape[-1]).float()
    for i in range(len(ctx)):
        s, e = cu[i], cu[i + 1]
        keys = gather_kv(k_cache, block_tables[i], ctx[i]).float().repeat_interleave(group, 1)
        vals = gather_kv(v_cache, block_tables[i], ctx[i]).float().repeat_interleave(group, 1)
        mask = causal_mask(e - s, ctx[i], window, q.device, ranges[i])
        o = attend(q[s:e].float().transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                   mask, scale, None)  # fmt: skip
        out[s:e] = o.transpose(0, 1)
    return out


def case_prefill(seqs, group, window=None, block_size=16, seed=0, device="cpu", dtype="float32"):
    """Max abs error (relative Frobenius on CUDA) of the kernel against the reference."""
    import torch

    from hf_paged.attention.bidirectional import query_key_ends
    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    q, kc, vc, bt, cu, ctx = _batch(seqs, group, block_size=block_size, seed=seed,
                                    device=device, dtype=dtype)  # fmt: skip
    ranges = [r for _, _, r in seqs]
    ends = query_key_ends(ranges, cu, ctx)
    assert ends is not None, "the case must hold a query inside a range"
    dev = q.device
    cu_t = torch.tensor(cu, dtype=torch.int32, device=dev)
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device=dev)
    ends_t = torch.tensor(ends, dtype=torch.int32, device=dev)
    out = torch.full_like(q, float("nan"))  # poison: every row must be written
    max_q = max(b - a for a, b in zip(cu, cu[1:]))
    paged_prefill(q, kc, vc, bt, cu_t, ctx_t, max_q, 0.125, window, query_key_ends=ends_t, out=out)
    ref = _reference(q, kc, vc, bt, cu, ctx, ranges, window, 0.125)
    # the kernel's own reference reads the same per-query ends
    own = paged_prefill_ref(q, kc, vc, bt, cu_t, ctx_t, 0.125, window, query_key_ends=ends_t)
    if not torch.isfinite(out).all():
        return float("inf")
    if device == "cpu":
        return max((out.float() - ref).abs().max().item(), (own.float() - ref).abs().max().item())
    return ((out.float() - ref).norm() / ref.norm()).item()


def case_random(seed, device="cpu", dtype="float32"):
    """Random chunks over cached prefixes, with random ranges that the chunk never ends inside."""
    import random

    rng = random.Random(seed)
    seqs = []
    for _ in range(4):
        ctx = rng.choice([1, 2, 16, 17, 31, 32, 33, 64, 90])
        ranges, pos = [], 0
        while pos < ctx - 1 and rng.random() < 0.8:
            a = rng.randrange(pos, ctx)
            b = rng.randrange(a + 1, ctx + 1)
            ranges.append((a, b))
            pos = b + rng.choice([0, 1, 5])
        # the chunk starts at 0, after a range, or inside one (never ends inside one)
        starts = [0] + [b for _, b in ranges if b < ctx] + [rng.randrange(a, b) for a, b in ranges]
        start = rng.choice(starts)
        seqs.append((ctx - start, ctx, ranges))
    seqs.append((40, 40, [(7, 40)]))  # so every batch holds a query inside a range
    window = rng.choice([None, 1, 5, 16, 33])
    return case_prefill(seqs, rng.choice([1, 2, 3, 4]), window, rng.choice([8, 16, 32]), seed,
                        device, dtype)  # fmt: skip


def case_backend(device="cpu", dtype="float32", bidirectional=True):
    """TritonBackend vs TorchRefBackend on one step built by ``StepInputs`` (store + prefill)
    for a Gemma-3-like sliding layer: the plumbing from chunks to kernel arguments. With
    ``bidirectional=False`` (Gemma 4's full layers) both stay causal, and the reference is
    checked against a step without ranges."""
    import torch

    from hf_paged.attention.base import AttentionLayerSpec
    from hf_paged.attention.torch_ref import TorchRefBackend
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.engine.core.contracts import ModelInput, ScheduledChunk
    from hf_paged.engine.worker.step_inputs import StepInputs

    dt = getattr(torch, dtype)
    bs, hkv, group, d = 16, 2, 2, 32
    chunks = [
        ScheduledChunk(0, [1] * 40, 24, list(range(0, 4)), True, bidirectional_ranges=[(20, 50)]),
        ScheduledChunk(1, [1] * 9, 0, list(range(4, 5)), True),
        ScheduledChunk(2, [1] * 33, 0, list(range(5, 8)), False, bidirectional_ranges=[(1, 33)]),
    ]
    _, _, meta, _ = StepInputs(torch.device(device), bs).build(ModelInput(chunks), None)
    gen = torch.Generator().manual_seed(3)
    t = sum(len(c.token_ids) for c in chunks)
    q, k, v = (torch.randn(t, n, d, generator=gen).to(device, dt) for n in (hkv * group, hkv, hkv))
    caches = [torch.randn(8, bs, hkv, d, generator=gen).to(device, dt) for _ in range(2)]
    spec = AttentionLayerSpec(hkv * group, hkv, d, 0.125, sliding_window=12,
                              bidirectional=bidirectional)  # fmt: skip
    ref_caches = [c.clone() for c in caches]
    out = TritonBackend().forward(q, k, v, *caches, meta, spec)
    if not bidirectional:  # the oracle: the same step built without ranges
        for c in chunks:
            c.bidirectional_ranges = []
        _, _, meta, _ = StepInputs(torch.device(device), bs).build(ModelInput(chunks), None)
    ref = TorchRefBackend().forward(q.float(), k.float(), v.float(),
                                    *(c.float() for c in ref_caches), meta, spec)  # fmt: skip
    if device == "cpu":
        return (out - ref).abs().max().item()
    return ((out.float() - ref).norm() / ref.norm()).item()


def case_backend_causal_layer(device="cpu", dtype="float32"):
    return case_backend(device, dtype, bidirectional=False)


CASES = {"backend_sliding_layer": (case_backend, ()),
         "backend_causal_layer": (case_backend_causal_layer, ())}  # fmt: skip
for _g in (1, 2, 3, 4, 8):
    CASES[f"block_edges_g{_g}"] = (case_prefill, (EDGE_SEQS, _g))
    CASES[f"chunk_starts_g{_g}"] = (case_prefill, (CHUNK_SEQS, _g))
for _w in (1, 5, 16, 33):
    CASES[f"block_edges_window{_w}"] = (case_prefill, (EDGE_SEQS, 2, _w))
    CASES[f"chunk_starts_window{_w}_bs8"] = (case_prefill, (CHUNK_SEQS, 2, _w, 8))
for _s in range(6):
    CASES[f"random_{_s}"] = (case_random, (_s,))




@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(interpreted, case):
    result = interpreted[case]
    assert result < TOL, f"{case}: max abs error {result}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference_on_device(case, dtype):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    fn, args = CASES[case]
    assert fn(*args, device="cuda", dtype=dtype) < GPU_TOL[dtype]


if __name__ == "__main__":
    interpret_main(CASES)
