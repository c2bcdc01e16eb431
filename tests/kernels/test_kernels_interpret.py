"""Triton kernels vs their torch references under Triton's CPU interpreter (tiny fp32 shapes).

``TRITON_INTERPRET=1`` only takes effect if set before triton is imported, and another test
module may already have imported triton in this process, so every check runs in one child
process (this file run as a script) that prints ``{case: max_abs_error}`` as JSON; the tests
here just read that table. Numerics of fp16/bf16 and speed are checked on the GPU
(tests/kernels/test_paged_attention_kernels.py).
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main, run_interpreter_cases

TOL = 1e-4  # fp32 everywhere (the interpreter's dot is a numpy fp32 matmul)

# (q_len, context_len) per sequence: single tokens, exact block boundaries (16, 32) and one past
# them (17, 33), a cached prefix under a short chunk, a chunk over a long prefix, multi-tile rows.
PREFILL_SEQS = [(1, 1), (16, 16), (17, 17), (5, 37), (40, 100), (1, 64), (33, 65)]
DECODE_LENS = [1, 16, 17, 32, 33, 160, 300]


def _batch(seqs, num_heads, num_kv_heads, head_dim=64, block_size=16, seed=0):
    """Random paged batch: shuffled block ids, block_tables padded with 0 and one spare column."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for _, ctx in seqs]
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    ids = torch.randperm(num_blocks, generator=gen).int()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = ids[used : used + n]
        used += n
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


def case_decode(group, num_partitions, window=None, block_size=16, lens=DECODE_LENS):
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode, paged_decode_ref

    num_kv_heads = 2
    q, kc, vc, bt, _, ctx, _ = _batch([(1, n) for n in lens], group * num_kv_heads, num_kv_heads,
                                      block_size=block_size, seed=group)  # fmt: skip
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    paged_decode(q, kc, vc, bt, ctx, 0.125, window, num_partitions=num_partitions, out=out)
    return _max_err(out, paged_decode_ref(q, kc, vc, bt, ctx, 0.125, window))


def case_decode_padding():
    """CUDA-graph padding rows: context_len 0 gives zeros, with and without split-K."""
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode

    q, kc, vc, bt, _, ctx, _ = _batch([(1, 200), (1, 1), (1, 1)], 4, 2)
    ctx[1:] = 0
    err = 0.0
    for parts in (1, 3):
        out = paged_decode(q, kc, vc, bt, ctx, 0.125, num_partitions=parts)
        err = max(err, _max_err(out[1:], torch.zeros_like(out[1:])))
    return err


def case_prefill(group, window=None, block_size=16, seqs=PREFILL_SEQS, num_kv_heads=2, seed=0):
    import torch

    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    q, kc, vc, bt, cu, ctx, max_q = _batch(seqs, group * num_kv_heads, num_kv_heads,
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
    q, kc, vc, bt, cu, ctx, max_q = _batch(seqs, 4, 2)
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
    q, kc, vc, bt, cu, ctx, max_q = _batch([(40, 40)], 2, 2)
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
CASES["prefill_g3_window33"] = (case_prefill, (3, 33, 16, PREFILL_SEQS[3:], 1))
for _s in range(4):
    CASES[f"prefill_random_{_s}"] = (case_prefill_random, (_s,))
# every cached-prefix length mod the 32-key tile: hits each edge of the masked/unmasked key runs
SWEEP_SEQS = [(3, prefix + 3) for prefix in range(31, 65)]
for _w in (None, 5, 33):
    CASES[f"prefill_prefix_sweep_window{_w}"] = (case_prefill, (2, _w, 16, SWEEP_SEQS))


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    return run_interpreter_cases(__file__, timeout=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_reference(interpreter_results, case):
    result = interpreter_results[case]
    assert isinstance(result, float), result  # a string is the child's traceback
    assert result < TOL, f"{case}: max abs error {result}"


if __name__ == "__main__":
    interpret_main(CASES)
