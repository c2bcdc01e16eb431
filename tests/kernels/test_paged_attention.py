"""Triton kernels vs their torch references under Triton's CPU interpreter (tiny fp32 shapes).

``TRITON_INTERPRET=1`` only takes effect if set before triton is imported, and another test
module may already have imported triton in this process, so every check runs in one child
process (this file run as a script) that prints ``{case: max_abs_error}`` as JSON; the tests
here just read that table. Numerics of fp16/bf16 and speed are checked on the GPU
(below, marker ``gpu``).

Triton kernels vs their torch references on a CUDA device (fp16/bf16/fp32, head_dim 64/128).

Also checks the TritonBackend end to end: the aten flash path for pure prefill, the paged path
over cached prefixes, and decode captured in a CUDA graph and replayed on new metadata.
"""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing.markers import marked
from tests.kernels.interpret_utils import interpret_main, random_paged_kv

# ---- under Triton's CPU interpreter (the cases run in one child process) --------------------------


TOL_FP32 = 1e-4  # fp32 everywhere (the interpreter's dot is a numpy fp32 matmul)


# (q_len, context_len) per sequence: single tokens, exact block boundaries (16, 32) and one past
# them (17, 33), a cached prefix under a short chunk, a chunk over a long prefix, multi-tile rows.
PREFILL_SEQS_FP32 = [(1, 1), (16, 16), (17, 17), (5, 37), (40, 100), (1, 64), (33, 65)]


DECODE_LENS_FP32 = [1, 16, 17, 32, 33, 160, 300]


def _batch_fp32(seqs, num_heads, num_kv_heads, head_dim=64, block_size=16, seed=0):
    """Random paged batch: shuffled block ids, block_tables padded with 0 and one spare column."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = random_paged_kv(
        [ctx for _, ctx in seqs], num_kv_heads, head_dim, block_size, gen
    )
    q_lens = [q_len for q_len, _ in seqs]
    cu = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen)
    return q, k_cache, v_cache, block_tables, cu, ctx, max(q_lens)


def _max_err(out, ref):
    import torch

    if not torch.isfinite(out).all():
        return float("inf")
    return (out.float() - ref.float()).abs().max().item()


def case_store(num_kv_heads, head_dim):
    import torch

    from hf_paged.kernels.attention.kv_store import store_kvcache, store_kvcache_ref

    gen = torch.Generator().manual_seed(1)
    num_tokens, block_size = 21, 16
    # k/v as strided views of a fused projection, like the model hands them over
    kv = torch.randn(num_tokens, 2 * num_kv_heads + 1, head_dim, generator=gen)
    k, v = kv[:, :num_kv_heads], kv[:, num_kv_heads : 2 * num_kv_heads]
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[[0, 5, 20]] = -1
    caches = [torch.randn(6, block_size, num_kv_heads, head_dim, generator=gen) for _ in range(2)]
    ref = [c.clone() for c in caches]
    store_kvcache(k, v, caches[0], caches[1], slots)
    store_kvcache_ref(k, v, ref[0], ref[1], slots)
    return max(_max_err(caches[0], ref[0]), _max_err(caches[1], ref[1]))


def case_decode(group, num_partitions, window=None, block_size=16, lens=DECODE_LENS_FP32):
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode, paged_decode_ref

    num_kv_heads = 2
    q, kc, vc, bt, _, ctx, _ = _batch_fp32([(1, n) for n in lens], group * num_kv_heads, num_kv_heads,
                                      block_size=block_size, seed=group)  # fmt: skip
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    paged_decode(q, kc, vc, bt, ctx, 0.125, window, num_partitions=num_partitions, out=out)
    return _max_err(out, paged_decode_ref(q, kc, vc, bt, ctx, 0.125, window))


def case_decode_padding():
    """CUDA-graph padding rows: context_len 0 gives zeros, with and without split-K."""
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode

    q, kc, vc, bt, _, ctx, _ = _batch_fp32([(1, 200), (1, 1), (1, 1)], 4, 2)
    ctx[1:] = 0
    err = 0.0
    for parts in (1, 3):
        out = paged_decode(q, kc, vc, bt, ctx, 0.125, num_partitions=parts)
        err = max(err, _max_err(out[1:], torch.zeros_like(out[1:])))
    return err


def case_prefill(group, window=None, block_size=16, seqs=PREFILL_SEQS_FP32, num_kv_heads=2, seed=0):
    import torch

    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    q, kc, vc, bt, cu, ctx, max_q = _batch_fp32(seqs, group * num_kv_heads, num_kv_heads,
                                           block_size=block_size, seed=seed)  # fmt: skip
    out = torch.full_like(q, float("nan"))
    paged_prefill(q, kc, vc, bt, cu, ctx, max_q, 0.125, window, out=out)
    return _max_err(out, paged_prefill_ref(q, kc, vc, bt, cu, ctx, 0.125, window))


def case_prefill_random(seed):
    """Random ragged batch / group / window / block size (exercises the 3 key runs' edges)."""
    import random

    rng = random.Random(seed)
    seqs = []
    for _ in range(4):
        q_len = rng.choice([1, 2, 31, 32, 33, 70])
        seqs.append((q_len, q_len + rng.choice([0, 0, 1, 15, 16, 63, 100])))
    window = rng.choice([None, 1, 8, 31, 32, 33, 90])
    return case_prefill(rng.choice([1, 2, 4]), window, rng.choice([8, 16, 32]), seqs, seed=seed)


def case_backend():
    """TritonBackend on CPU: store + paged prefill over a cached prefix, then one decode step."""
    import torch

    from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.kernels.attention.paged_decode import paged_decode_ref
    from hf_paged.kernels.attention.paged_prefill import paged_prefill_ref

    spec = AttentionLayerSpec(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125)
    seqs = [(20, 20), (7, 40)]  # a fresh prompt and a chunk over 33 cached tokens
    q, kc, vc, bt, cu, ctx, max_q = _batch_fp32(seqs, 4, 2)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(q.shape[0], 2, 64, generator=gen) for _ in range(2))
    bs = kc.shape[1]
    pos = [p for q_len, c in seqs for p in range(c - q_len, c)]
    seq_of = [i for i, (q_len, _) in enumerate(seqs) for _ in range(q_len)]
    slots = torch.tensor(
        [int(bt[i, p // bs]) * bs + p % bs for i, p in zip(seq_of, pos, strict=True)]
    )
    meta = AttentionMetadata(False, 2, slots, cu, ctx, bt, max_q, int(ctx.max()),
                             cu.tolist(), ctx.tolist())  # fmt: skip
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kc_ref.view(-1, 2, 64)[slots], vc_ref.view(-1, 2, 64)[slots] = k, v
    backend = TritonBackend()
    out = backend.forward(q, k, v, kc, vc, meta, spec)
    err = _max_err(out, paged_prefill_ref(q, kc_ref, vc_ref, bt, cu, ctx, 0.125))
    err = max(err, _max_err(kc, kc_ref), _max_err(vc, vc_ref))
    # decode: one more token per sequence
    ctx_d = ctx + 1
    slots_d = torch.tensor([int(bt[i, c // bs]) * bs + c % bs for i, c in enumerate(ctx.tolist())])
    qd, kd, vd = (torch.randn(2, h, 64, generator=gen) for h in (4, 2, 2))
    meta_d = AttentionMetadata(True, 2, slots_d, torch.arange(3, dtype=torch.int32), ctx_d, bt,
                               1, int(ctx_d.max()))  # fmt: skip
    out_d = backend.forward(qd, kd, vd, kc, vc, meta_d, spec)
    return max(err, _max_err(out_d, paged_decode_ref(qd, kc, vc, bt, ctx_d, 0.125)))


def case_backend_uncovered_raises():
    """Prefill whose block tables cannot hold the context, off CUDA: a clear ValueError."""
    import torch

    from hf_paged.attention.base import AttentionLayerSpec, AttentionMetadata
    from hf_paged.attention.triton_backend import TritonBackend

    spec = AttentionLayerSpec(num_heads=2, num_kv_heads=2, head_dim=64, scale=0.125)
    q, kc, vc, bt, cu, ctx, max_q = _batch_fp32([(40, 40)], 2, 2)
    slots = torch.full((40,), -1, dtype=torch.int64)
    meta = AttentionMetadata(False, 1, slots, cu, ctx, bt[:, :1], 40, 40, [0, 40], [40])
    try:
        TritonBackend().forward(q, q, q, kc, vc, meta, spec)
    except ValueError:
        return 0.0
    return float("inf")


CASES = {
    "backend_uncovered_raises": (case_backend_uncovered_raises, ()),
    "store_h2_d64": (case_store, (2, 64)),
    "store_h3_d48": (case_store, (3, 48)),
    "decode_padding_rows": (case_decode_padding, ()),
    "backend_prefill_then_decode": (case_backend, ()),
}


for _g in (1, 2, 4, 8):
    for _p in (1, 4):
        CASES[f"decode_g{_g}_p{_p}"] = (case_decode, (_g, _p))
    CASES[f"prefill_g{_g}"] = (case_prefill, (_g,))


CASES["decode_g2_window50_p1"] = (case_decode, (2, 1, 50))


CASES["decode_g2_window50_p4"] = (case_decode, (2, 4, 50))


CASES["decode_g2_bs8_p2"] = (case_decode, (2, 2, None, 8))


CASES["decode_g2_bs32_p3"] = (case_decode, (2, 3, None, 32))


CASES["prefill_g2_window1"] = (case_prefill, (2, 1))


CASES["prefill_g2_window7"] = (case_prefill, (2, 7))


CASES["prefill_g2_window40_bs32"] = (case_prefill, (2, 40, 32))


CASES["prefill_g3_window33"] = (case_prefill, (3, 33, 16, PREFILL_SEQS_FP32[3:], 1))


for _s in range(4):
    CASES[f"prefill_random_{_s}"] = (case_prefill_random, (_s,))


# every cached-prefix length mod the 32-key tile: hits each edge of the masked/unmasked key runs
SWEEP_SEQS = [(3, prefix + 3) for prefix in range(31, 65)]


for _w in (None, 5, 33):
    CASES[f"prefill_prefix_sweep_window{_w}"] = (case_prefill, (2, _w, 16, SWEEP_SEQS))




@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(interpreted, case):
    result = interpreted[case]
    assert result < TOL_FP32, f"{case}: max abs error {result}"


# ---- on CUDA --------------------------------------------------------------------------------------


_MARKS_PAGED_ATTENTION_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


# relative Frobenius error ||out - ref|| / ||ref|| against an fp32 reference
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


DECODE_LENS = [1, 15, 16, 17, 255, 256, 257, 1000, 4097]


# (q_len, context_len): plain prompts, exact block edges, chunks over cached prefixes
PREFILL_SEQS = [(1, 1), (16, 16), (17, 17), (128, 128), (129, 129), (300, 300), (1, 513),
                (64, 1024), (250, 777), (513, 1025)]  # fmt: skip


def _batch(seqs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    """Random paged batch on the GPU: shuffled block ids, block_tables padded with 0."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 7
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    ids = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 3, dtype=torch.int32, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n]
        used += n
    q_lens = [q_len for q_len, _ in seqs]
    cu = torch.tensor([0] + q_lens, device="cuda").cumsum(0).int()
    ctx = torch.tensor([c for _, c in seqs], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), num_heads, head_dim, generator=gen, device="cuda").to(dtype)
    return q, k_cache, v_cache, block_tables, cu, ctx, max(q_lens)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
def test_store_kvcache_matches_reference():
    from hf_paged.kernels.attention.kv_store import store_kvcache, store_kvcache_ref

    num_tokens, num_kv_heads, head_dim, block_size = 1000, 8, 128, 16
    qkv = torch.randn(num_tokens, 32, head_dim, device="cuda", dtype=torch.bfloat16)
    k, v = qkv[:, 16:24], qkv[:, 24:32]  # strided views of a fused projection
    slots = torch.randperm(200 * block_size, device="cuda")[:num_tokens]
    slots[::7] = -1
    caches = [torch.randn(200, block_size, num_kv_heads, head_dim, device="cuda") for _ in "kv"]
    caches = [c.bfloat16() for c in caches]
    ref = [c.clone() for c in caches]
    store_kvcache(k, v, *caches, slots)
    store_kvcache_ref(k, v, *ref, slots)
    assert torch.equal(caches[0], ref[0]) and torch.equal(caches[1], ref[1])


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_paged_decode_dtypes_and_groups(dtype, head_dim, group):
    from hf_paged.kernels.attention.paged_decode import paged_decode, paged_decode_ref

    seqs = [(1, n) for n in DECODE_LENS]
    q, kc, vc, bt, _, ctx, _ = _batch(seqs, 4 * group, 4, head_dim, dtype, seed=group)
    scale = head_dim**-0.5
    ref = paged_decode_ref(q, kc, vc, bt, ctx, scale)
    for parts in (None, 1, 6):
        out = paged_decode(q, kc, vc, bt, ctx, scale, num_partitions=parts)
        assert _rel_err(out, ref) < TOL[dtype], f"num_partitions={parts}"


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("window", [1, 100, 4096])
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_decode_window_and_block_size(window, block_size):
    from hf_paged.kernels.attention.paged_decode import paged_decode, paged_decode_ref

    seqs = [(1, n) for n in DECODE_LENS]
    q, kc, vc, bt, _, ctx, _ = _batch(seqs, 16, 8, 128, torch.bfloat16, block_size)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.088, window)
    for parts in (1, 8):
        out = paged_decode(q, kc, vc, bt, ctx, 0.088, window, num_partitions=parts)
        assert _rel_err(out, ref) < TOL[torch.bfloat16]


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_paged_prefill_dtypes_and_groups(dtype, head_dim, group):
    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    q, kc, vc, bt, cu, ctx, max_q = _batch(PREFILL_SEQS, 4 * group, 4, head_dim, dtype, seed=group)
    scale = head_dim**-0.5
    out = paged_prefill(q, kc, vc, bt, cu, ctx, max_q, scale)
    assert _rel_err(out, paged_prefill_ref(q, kc, vc, bt, cu, ctx, scale)) < TOL[dtype]


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("window", [1, 63, 64, 65, 500])
@pytest.mark.parametrize("block_size", [8, 16, 64])
def test_paged_prefill_window_and_block_size(window, block_size):
    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    q, kc, vc, bt, cu, ctx, max_q = _batch(PREFILL_SEQS, 16, 8, 128, torch.bfloat16, block_size)
    out = paged_prefill(q, kc, vc, bt, cu, ctx, max_q, 0.088, window)
    ref = paged_prefill_ref(q, kc, vc, bt, cu, ctx, 0.088, window)
    assert _rel_err(out, ref) < TOL[torch.bfloat16]


def _meta(seqs, block_tables, block_size, is_decode):
    """AttentionMetadata whose slots are the new tokens' positions in ``block_tables``."""
    from hf_paged.attention.base import AttentionMetadata

    slots, cu = [], [0]
    for i, (q_len, ctx) in enumerate(seqs):
        for pos in range(ctx - q_len, ctx):
            slots.append(int(block_tables[i, pos // block_size]) * block_size + pos % block_size)
        cu.append(cu[-1] + q_len)
    dev = block_tables.device
    return AttentionMetadata(
        is_decode=is_decode,
        num_seqs=len(seqs),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
        context_lens=torch.tensor([c for _, c in seqs], dtype=torch.int32, device=dev),
        block_tables=block_tables,
        max_seqlen_q=max(q for q, _ in seqs),
        max_context_len=max(c for _, c in seqs),
        cu_seqlens_q_cpu=cu,
        context_lens_cpu=[c for _, c in seqs],
    )


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("use_flash", [False, True])
@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize("cached", [False, True])
def test_backend_prefill(window, cached, use_flash):
    """Pure prefill may take the aten flash path; prefill over a cached prefix the paged kernel."""
    from hf_paged.attention.base import AttentionLayerSpec
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.kernels.attention.paged_prefill import paged_prefill_ref

    seqs = [(q, q + 37 * cached) for q in (1, 16, 17, 300, 1000)]
    q, kc, vc, bt, cu, ctx, _ = _batch(seqs, 16, 8, 128, torch.bfloat16)
    k, v = (torch.randn(q.shape[0], 8, 128, device="cuda").bfloat16() for _ in "kv")
    spec = AttentionLayerSpec(16, 8, 128, 0.088, window)
    meta = _meta(seqs, bt, kc.shape[1], is_decode=False)
    backend = TritonBackend(use_flash_prefill=use_flash)
    out = backend.forward(q, k, v, kc, vc, meta, spec)
    ref = paged_prefill_ref(q, kc, vc, bt, cu, ctx, 0.088, window)  # reads what forward stored
    assert _rel_err(out, ref) < TOL[torch.bfloat16]
    flash_expected = use_flash and not cached
    assert backend._flash_ok is (True if flash_expected else None), "wrong prefill route"


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
def test_backend_warmup_without_cache_uses_flash():
    """The runner's warm-up: 1-block placeholder cache, 1-column block tables, slots -1."""
    from hf_paged.attention.base import AttentionLayerSpec
    from hf_paged.attention.triton_backend import TritonBackend

    seqs = [(n, n) for n in (5, 300, 1024)]
    q, kc, vc, bt, _, _, _ = _batch(seqs, 16, 8, 128, torch.bfloat16)
    k, v = (torch.randn(q.shape[0], 8, 128, device="cuda").bfloat16() for _ in "kv")
    spec = AttentionLayerSpec(16, 8, 128, 0.088, None)
    full = _meta(seqs, bt, kc.shape[1], is_decode=False)
    expected = TritonBackend().forward(q, k, v, kc, vc, full, spec)  # paged path, full cache
    warm = _meta(seqs, bt, kc.shape[1], is_decode=False)
    warm.block_tables = torch.zeros(len(seqs), 1, dtype=torch.int32, device="cuda")
    warm.slot_mapping.fill_(-1)
    placeholder = torch.zeros(1, 16, 8, 128, device="cuda", dtype=torch.bfloat16)
    out = TritonBackend().forward(q, k, v, placeholder, placeholder.clone(), warm, spec)
    assert _rel_err(out, expected) < TOL[torch.bfloat16]


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("batch", [3, 64])
def test_backend_decode_cuda_graph(batch):
    """Capture store + decode once, replay on new metadata values (shapes fixed): still exact."""
    from hf_paged.attention.base import AttentionLayerSpec
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.kernels.attention.paged_decode import paged_decode_ref

    spec = AttentionLayerSpec(16, 8, 128, 0.088, None)
    seqs = [(1, 1000)] * batch  # sizes the cache and the block table
    _, kc, vc, bt, _, _, _ = _batch(seqs, 16, 8, 128, torch.bfloat16)
    static = _meta(seqs, bt.clone(), kc.shape[1], is_decode=True)
    q, k, v = (torch.randn(batch, h, 128, device="cuda").bfloat16() for h in (16, 8, 8))
    backend = TritonBackend()
    backend.forward(q, k, v, kc, vc, static, spec)  # warm up: compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kc, vc, static, spec)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lens = torch.randint(1, 1000, (batch,), generator=gen).tolist()
        new = _meta([(1, n) for n in lens], bt[torch.randperm(batch)], kc.shape[1], True)
        for name in ("slot_mapping", "context_lens", "block_tables"):
            getattr(static, name).copy_(getattr(new, name))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        kc_ref, vc_ref = kc.clone(), vc.clone()
        kc_ref.view(-1, 8, 128)[new.slot_mapping] = k
        vc_ref.view(-1, 8, 128)[new.slot_mapping] = v
        graph.replay()
        assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref), "k/v not stored at new slots"
        ref = paged_decode_ref(q, kc, vc, new.block_tables, new.context_lens, 0.088)
        assert _rel_err(out, ref) < TOL[torch.bfloat16]


# name -> (AttentionLayerSpec args, sinks?, q multiplier that makes the modifier matter)
MODIFIED_SPECS = {
    "gemma2": (dict(num_heads=8, num_kv_heads=4, head_dim=256, scale=256**-0.5, softcap=50.0,
                    sliding_window=None), False, 8.0),
    "gemma2_window": (dict(num_heads=8, num_kv_heads=4, head_dim=256, scale=256**-0.5,
                           softcap=50.0, sliding_window=100), False, 8.0),
    "mla": (dict(num_heads=16, num_kv_heads=16, head_dim=192, head_dim_v=128,
                 scale=192**-0.5), False, 1.0),
    "gpt_oss": (dict(num_heads=16, num_kv_heads=2, head_dim=64, scale=0.125,
                     sliding_window=128), True, 1.0),
    "alibi_d80": (dict(num_heads=8, num_kv_heads=2, head_dim=80, scale=80**-0.5,
                       alibi_slopes=tuple(2.0 ** (-(i + 1) / 2) for i in range(8))), False, 1.0),
}  # fmt: skip


MODIFIED_PREFILL = [(1, 1), (16, 16), (17, 17), (300, 300), (64, 1024), (250, 777)]


MODIFIED_DECODE = [1, 17, 256, 257, 1000, 3000]


def _modified_case(name, seqs, dtype, seed=0):
    """Spec, caches (K and V apart when their head dims differ), metadata, q/k/v and sinks."""
    from hf_paged.attention.base import AttentionLayerSpec

    kw, with_sinks, q_mult = MODIFIED_SPECS[name]
    spec = AttentionLayerSpec(**kw)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    block_size = 16
    q, kc, _, bt, _, _, _ = _batch(seqs, spec.num_heads, spec.num_kv_heads, spec.head_dim, dtype,
                                   block_size, seed)  # fmt: skip
    vc = torch.randn(*kc.shape[:3], spec.v_head_dim, generator=gen, device="cuda").to(dtype)
    meta = _meta(seqs, bt, block_size, is_decode=all(q_len == 1 for q_len, _ in seqs))
    q = (q.float() * q_mult).to(dtype)
    k = torch.randn(q.shape[0], spec.num_kv_heads, spec.head_dim, generator=gen, device="cuda")
    v = torch.randn(q.shape[0], spec.num_kv_heads, spec.v_head_dim, generator=gen, device="cuda")
    sinks = torch.randn(spec.num_heads, generator=gen, device="cuda") * 2 if with_sinks else None
    return spec, kc, vc, meta, q, k.to(dtype), v.to(dtype), sinks


def _reference(spec, kc, vc, meta, q, k, v, sinks):
    """The torch reference in fp32 over the caches ``forward`` filled (new K/V stored)."""
    from hf_paged.attention.torch_ref import TorchRefBackend

    f = [t.float() for t in (q, k, v, kc, vc)]
    return TorchRefBackend().forward(*f, meta, spec, kv_stored=True, sinks=sinks)


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(MODIFIED_SPECS))
def test_backend_modified_specs_prefill(name, dtype):
    from hf_paged.attention.triton_backend import TritonBackend

    spec, kc, vc, meta, q, k, v, sinks = _modified_case(name, MODIFIED_PREFILL, dtype)
    backend = TritonBackend()
    assert backend.problem(spec, dtype, 16) is None
    out = backend.forward(q, k, v, kc, vc, meta, spec, sinks=sinks)
    assert out.shape == (q.shape[0], spec.num_heads, spec.v_head_dim)
    assert _rel_err(out, _reference(spec, kc, vc, meta, q, k, v, sinks)) < TOL[dtype]


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", sorted(MODIFIED_SPECS))
def test_backend_modified_specs_decode_split_k(name, dtype):
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.kernels.attention.paged_decode import paged_decode

    seqs = [(1, n) for n in MODIFIED_DECODE]
    spec, kc, vc, meta, q, k, v, sinks = _modified_case(name, seqs, dtype)
    backend = TritonBackend()
    out = backend.forward(q, k, v, kc, vc, meta, spec, sinks=sinks)  # default split
    ref = _reference(spec, kc, vc, meta, q, k, v, sinks)
    assert _rel_err(out, ref) < TOL[dtype], "default num_partitions"
    slopes = backend._alibi_slopes(spec, q.device)
    for parts in (1, 7):
        out = paged_decode(q, kc, vc, meta.block_tables, meta.context_lens, spec.scale,
                           spec.sliding_window, softcap=spec.softcap, alibi_slopes=slopes,
                           sinks=sinks, num_partitions=parts)  # fmt: skip
        assert _rel_err(out, ref) < TOL[dtype], f"num_partitions={parts}"


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("name", ["gemma2_window", "gpt_oss", "mla", "alibi_d80"])
def test_backend_modified_decode_cuda_graph(name):
    """Store + decode with softcap / sinks / Dv != D / ALiBi captured once, replayed on new
    metadata: the sink and slope tensors keep their addresses, so replays stay exact."""
    from hf_paged.attention.triton_backend import TritonBackend

    batch = 8
    spec, kc, vc, static, q, k, v, sinks = _modified_case(name, [(1, 1000)] * batch,
                                                          torch.bfloat16)  # fmt: skip
    backend = TritonBackend()
    backend.forward(q, k, v, kc, vc, static, spec, sinks=sinks)  # compile outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, kc, vc, static, spec, sinks=sinks)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        lens = torch.randint(1, 1000, (batch,), generator=gen).tolist()
        perm = torch.randperm(batch, generator=gen).cuda()
        new = _meta([(1, n) for n in lens], static.block_tables[perm], kc.shape[1], True)
        for name_ in ("slot_mapping", "context_lens", "block_tables"):
            getattr(static, name_).copy_(getattr(new, name_))
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, _reference(spec, kc, vc, new, q, k, v, sinks)) < TOL[torch.bfloat16]


@marked(_MARKS_PAGED_ATTENTION_KERNELS)
@pytest.mark.parametrize("model_type", ["gemma2", "gpt_oss"])
def test_generic_models_run_every_layer_in_the_kernels(model_type):
    """Gemma2 (softcap) and GPT-OSS (sinks, window) tiny models on CUDA: no layer falls back to
    the torch reference, sink layers run the Triton backend, and tokens equal stock's."""
    from hf_paged import LLM, SamplingParams
    from hf_paged.testing import build_tiny, hf_greedy

    _, hf = build_tiny(model_type)
    hf = hf.cuda()
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=16, min_tokens=16)
    with LLM(hf, max_model_len=128, kv_block_size=16, num_kv_blocks=64) as llm:
        runner = llm.engine.executor.runner
        assert runner.ctx.fallbacks == {}, runner.ctx.fallbacks
        if model_type == "gemma2":  # dense: nothing syncs the host, so decode is captured
            assert runner.graph_runner is not None, runner.cuda_graph_reason
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(hf, prompts, new_tokens=16)


if __name__ == "__main__":
    interpret_main(CASES)
