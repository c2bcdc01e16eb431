"""The batched torch backend against the torch reference (its oracle) on the same paged caches:
prefill, prefill over a cached prefix, decode and mixed steps; prompts of length 1; contexts that
end on and straddle block boundaries; GQA, sliding windows, softcap, ALiBi, sinks, V head dim !=
K head dim; fp32 and bf16; and no cache at all (a profile pass). Under bf16 autocast, each
sequence's output is bit for bit SDPA over its own keys (stock's call for that prompt alone)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.attention import torch_batched
from hf_paged.attention.base import AttentionLayerSpec
from hf_paged.attention.torch_batched import TorchBatchedBackend
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.testing import build_metadata

BLOCK, MAX_BLOCKS = 4, 6

SPECS = {
    "mha": AttentionLayerSpec(4, 4, 16, 0.25),
    "gqa3": AttentionLayerSpec(9, 3, 16, 0.25),  # SmolLM2's grouping (9 q heads, 3 kv heads)
    "mqa_window": AttentionLayerSpec(4, 1, 8, 0.35, sliding_window=3),
    "gqa_window": AttentionLayerSpec(4, 2, 16, 0.25, sliding_window=5),
    "dv_softcap": AttentionLayerSpec(4, 2, 8, 0.5, head_dim_v=24, softcap=2.0),
    "alibi_gqa_window": AttentionLayerSpec(
        4, 2, 16, 0.3, sliding_window=4, alibi_slopes=(0.5, 0.25, 0.125, 0.0625)
    ),
}

# each step: (q_len, context_len) per sequence. Context lengths 4, 8, 12 end on a block
# boundary (BLOCK = 4); 5, 9, 13 start a new block; length-1 prompts; a mixed step of decodes
# beside prefill chunks over a cached prefix; a sequence with an empty chunk.
STEPS = [
    [(1, 1), (4, 4), (5, 5), (11, 11), (1, 1)],  # prompts only (lengths 1, a full block, ...)
    [(1, 2), (4, 8), (1, 6), (2, 13), (1, 2)],  # decode beside chunks over a cached prefix
    [(1, 3), (1, 9), (3, 9), (1, 14), (1, 3)],  # mixed, straddling blocks
    [(1, 4), (1, 10), (1, 10), (1, 15), (1, 4)],  # decode only
    [(1, 5), (1, 11), (0, 10), (1, 16), (1, 5)],  # an empty chunk (q_len 0) in the step
]


def _tensors(spec, seqs_len, dtype, g):
    h, hkv, d, dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    return [(torch.randn(n, h, d, generator=g).to(dtype) * 2,
             torch.randn(n, hkv, d, generator=g).to(dtype) * 2,
             torch.randn(n, hkv, dv, generator=g).to(dtype)) for n in seqs_len]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize("grouped", [False, True], ids=["one_call", "grouped"])
def test_batched_equals_the_reference_over_steps(name, dtype, with_sinks, grouped, monkeypatch):
    """``grouped``: prefill steps split into groups of sequences (here one per length: no
    padding allowed), each its own call, their outputs scattered back to the step's rows."""
    if grouped:
        monkeypatch.setattr(torch_batched, "_MAX_PADDING", 1.0)
        monkeypatch.setattr(torch_batched, "_SMALL_PAIRS", 0)
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    total = [max(c for _, c in col) for col in zip(*STEPS)]
    seqs = _tensors(spec, total, dtype, g)
    sinks = torch.randn(spec.num_heads, generator=g) if with_sinks else None
    num_blocks = len(total) * MAX_BLOCKS
    shape_k = (num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim)
    shape_v = (num_blocks, BLOCK, spec.num_kv_heads, spec.v_head_dim)
    caches = {b: (torch.zeros(shape_k, dtype=dtype), torch.zeros(shape_v, dtype=dtype))
              for b in ("ref", "batched")}  # fmt: skip
    ref, batched = TorchRefBackend(), TorchBatchedBackend()
    for step in STEPS:
        q_lens, ends = [q for q, _ in step], [c for _, c in step]
        meta, _ = build_metadata(q_lens, ends, BLOCK, MAX_BLOCKS)
        new = [torch.cat([s[j][e - n : e] for s, (n, e) in zip(seqs, step)]) for j in range(3)]
        want = ref.forward(*new, *caches["ref"], meta, spec, sinks=sinks)
        got = batched.forward(*new, *caches["batched"], meta, spec, sinks=sinks)
        assert got.shape == want.shape == (sum(q_lens), spec.num_heads, spec.v_head_dim)
        assert got.dtype == want.dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        else:  # bf16 rounds probabilities (its explicit path) where SDPA keeps fp32: a few ulps
            torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=2e-2)
        torch.testing.assert_close(caches["batched"][0], caches["ref"][0], atol=0, rtol=0)
        torch.testing.assert_close(caches["batched"][1], caches["ref"][1], atol=0, rtol=0)


@pytest.mark.parametrize("name", ["gqa3", "mqa_window", "alibi_gqa_window"])
def test_batched_without_a_cache_attends_whole_prompts(name):
    """A profile pass (no cache): keys are the step's own rows; a chunk over cached tokens is
    refused by name, as the reference refuses it."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(1)
    lens = [1, 7, 4, 12]
    seqs = _tensors(spec, lens, torch.float32, g)
    meta, _ = build_metadata(lens, lens, BLOCK, MAX_BLOCKS)
    new = [torch.cat([s[j] for s in seqs]) for j in range(3)]
    want = TorchRefBackend().forward(*new, None, None, meta, spec)
    got = TorchBatchedBackend().forward(*new, None, None, meta, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    meta, _ = build_metadata([2, 3], [5, 3], BLOCK, MAX_BLOCKS)
    with pytest.raises(
        ValueError, match="sequence 0 has 3 cached tokens but meta.kv_cache is None"
    ):
        TorchBatchedBackend().forward(*[t[:5] for t in new], None, None, meta, spec)


def test_a_wrong_mask_would_fail():
    """The comparison has teeth: a batched step whose context lengths are off by one (one key
    too many for every sequence) differs from the reference."""
    spec = SPECS["gqa3"]
    g = torch.Generator().manual_seed(2)
    seqs = _tensors(spec, [9, 6], torch.float32, g)
    kc = torch.zeros(2 * MAX_BLOCKS, BLOCK, 3, 16)
    vc = torch.zeros_like(kc)
    meta, _ = build_metadata([9, 6], [9, 6], BLOCK, MAX_BLOCKS)
    new = [torch.cat([s[j] for s in seqs]) for j in range(3)]
    TorchBatchedBackend().forward(*new, kc, vc, meta, spec)  # fills the caches
    meta, _ = build_metadata([1, 1], [9, 6], BLOCK, MAX_BLOCKS)
    last = [torch.cat([s[j][-1:] for s in seqs]) for j in range(3)]
    want = TorchRefBackend().forward(*last, kc, vc, meta, spec, kv_stored=True)
    wrong, _ = build_metadata([1, 1], [9, 7], BLOCK, MAX_BLOCKS)
    got = TorchBatchedBackend().forward(*last, kc, vc, wrong, spec, kv_stored=True)
    assert not torch.allclose(got[1], want[1], atol=1e-3)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)


def test_prefill_steps_group_sequences_by_length_and_decode_steps_do_not():
    """Decode steps are one call whatever the context lengths; a prefill step's groups cover
    every sequence once, and padding a group costs at most twice its real work unless small."""
    assert torch_batched.group_sequences([1] * 5, [3, 900, 40, 7, 2]) == [[0, 1, 2, 3, 4]]
    q = [300, 1, 280, 40, 1, 35, 290]
    ctx = [300, 500, 280, 40, 20, 35, 290]
    groups = torch_batched.group_sequences(q, ctx)
    assert sorted(i for g in groups for i in g) == list(range(len(q)))
    assert len(groups) > 1  # the long prompts do not pad the decode of context 500
    for g in groups:
        padded = len(g) * max(q[i] for i in g) * max(ctx[i] for i in g)
        real = sum(q[i] * ctx[i] for i in g)
        assert padded <= max(2 * real, torch_batched._SMALL_PAIRS)


def test_bidirectional_ranges_are_attended_as_the_reference_does():
    """A step whose sequences name bidirectional ranges (an image's tokens see each other) gives
    the reference's output: the ranges are not dropped."""
    spec = SPECS["gqa3"]
    g = torch.Generator().manual_seed(3)
    seqs = _tensors(spec, [9, 6], torch.float32, g)
    meta, _ = build_metadata([9, 6], [9, 6], BLOCK, MAX_BLOCKS)
    meta.bidirectional_ranges = [[(2, 6)], []]
    new = [torch.cat([s[j] for s in seqs]) for j in range(3)]
    caches = [torch.zeros(2 * MAX_BLOCKS, BLOCK, 3, 16) for _ in range(4)]
    want = TorchRefBackend().forward(*new, caches[0], caches[1], meta, spec)
    got = TorchBatchedBackend().forward(*new, caches[2], caches[3], meta, spec)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    meta.bidirectional_ranges = None
    causal = TorchRefBackend().forward(*new, caches[0], caches[1], meta, spec, kv_stored=True)
    assert not torch.allclose(causal[2:6], want[2:6], atol=1e-3)  # the ranges matter here


def _alone(q, k, v, spec, decode: bool):
    """SDPA over one sequence's own keys, as stock calls it: q [L, H, D], k/v [ctx, Hkv, D];
    prefill causal (windowed by a mask), decode over the window's last keys with no mask."""
    import torch.nn.functional as F

    q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, heads, len, D]
    w = spec.sliding_window
    if decode:
        if w is not None:
            k, v = k[:, :, -w:], v[:, :, -w:]
        o = F.scaled_dot_product_attention(q, k, v, scale=spec.scale, enable_gqa=True)
    elif w is None:
        o = F.scaled_dot_product_attention(q, k, v, scale=spec.scale, is_causal=True,
                                           enable_gqa=True)  # fmt: skip
    else:
        pos = torch.arange(k.shape[2])
        mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < w)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=spec.scale,
                                           enable_gqa=True)  # fmt: skip
    return o[0].transpose(0, 1)  # [L, H, Dv]


@pytest.mark.parametrize("name", ["gqa3", "gqa_window"])
def test_under_bf16_autocast_each_sequence_attends_as_alone(name):
    """Under bf16 autocast SDPA's CPU kernel rounds by how many keys a call holds: the backend
    groups a step's sequences by equal lengths, so every sequence's output is bit for bit what
    SDPA over its own keys gives (stock's call for that prompt alone); prompts of length 1,
    contexts ending on and straddling blocks, then a decode step at those lengths."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(3)
    # long enough that padding the keys to the longest moves some outputs (it did, here)
    lens = [1, 4, 5, 13, 22, 25, 43, 55, 79, 124, 5]
    max_blocks = 32
    seqs = _tensors(spec, [n + 1 for n in lens], torch.float32, g)
    seqs = [(q, k, v.bfloat16().float()) for q, k, v in seqs]  # v as a bf16 projection gives it
    kc = torch.zeros(len(lens) * max_blocks, BLOCK, spec.num_kv_heads, spec.head_dim)
    vc = torch.zeros(len(lens) * max_blocks, BLOCK, spec.num_kv_heads, spec.v_head_dim)
    backend = TorchBatchedBackend()
    for decode in (False, True):
        q_lens = [1] * len(lens) if decode else lens
        ends = [n + 1 for n in lens] if decode else lens
        meta, _ = build_metadata(q_lens, ends, BLOCK, max_blocks)
        new = [torch.cat([s[j][e - n : e] for s, n, e in zip(seqs, q_lens, ends)])
               for j in range(3)]  # fmt: skip
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = backend.forward(*new, kc, vc, meta, spec)  # [T, H, Dv]
            assert got.dtype == torch.bfloat16
            starts = [sum(q_lens[:i]) for i in range(len(lens))]
            for i, (s, n, e) in enumerate(zip(seqs, q_lens, ends)):
                want = _alone(s[0][e - n : e], s[1][:e], s[2][:e], spec, decode)
                assert torch.equal(got[starts[i] : starts[i] + n], want), (decode, i)


def test_exact_groups_are_equal_query_and_context_lengths():
    assert torch_batched.group_exact([3, 1, 3, 1, 3], [3, 9, 3, 9, 5]) == [[0, 2], [1, 3], [4]]
    assert torch_batched.group_exact([1] * 3, [7, 7, 7]) == [[0, 1, 2]]  # GRPO's copies: one
