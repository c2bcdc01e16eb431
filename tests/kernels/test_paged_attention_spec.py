"""The Triton backend against the torch reference backend for every spec the generic path
records, under Triton's CPU interpreter (tiny fp32 shapes): score softcap, V head dim != K head
dim, head dims that are not powers of 2, ALiBi with GQA, attention sinks, and combinations with
a sliding window; over prefill (fresh prompts, a chunk over a cached prefix) and decode, with
and without split-K. Each case runs in one child process (see ``interpret_utils.py``).

The torch-only tests at the bottom check that every modifier changes the reference output far
beyond ``TOL`` on these batches, so a kernel that ignored one would fail here.
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main

TOL = 1e-4  # fp32 (the interpreter's dot is a numpy fp32 matmul)

# (q_len, context_len): a fresh prompt, a short chunk over a cached prefix, a multi-tile chunk
PREFILL_SEQS = [(9, 9), (16, 16), (17, 17), (5, 37), (40, 70)]
DECODE_LENS = [1, 17, 70, 150]


def _spec(h, hkv, d, dv=None, window=None, softcap=None, alibi=False):
    from hf_paged.attention.base import AttentionLayerSpec

    slopes = tuple(2.0 ** -(i + 1) for i in range(h)) if alibi else None
    return AttentionLayerSpec(h, hkv, d, d**-0.5, window, dv, softcap, slopes)


def _paged(seqs, spec, block_size=16, seed=0):
    """Random caches (K and V separate when their head dims differ, else one allocation),
    shuffled block tables, metadata and the new tokens' q/k/v."""
    import torch

    from hf_paged.attention.base import AttentionMetadata

    gen = torch.Generator().manual_seed(seed)
    nb_per = [-(-ctx // block_size) for _, ctx in seqs]
    nb, hkv, d, dv = sum(nb_per) + 2, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    if d == dv:  # like KVCache: [2, num_blocks, block_size, Hkv, D], K and V views of it
        kc, vc = torch.randn(2, nb, block_size, hkv, d, generator=gen).unbind(0)
    else:
        kc = torch.randn(nb, block_size, hkv, d, generator=gen)
        vc = torch.randn(nb, block_size, hkv, dv, generator=gen)
    ids = torch.randperm(nb, generator=gen).int()
    bt = torch.zeros(len(seqs), max(nb_per) + 1, dtype=torch.int32)
    used, slots, cu = 0, [], [0]
    for i, ((q_len, ctx), n) in enumerate(zip(seqs, nb_per, strict=True)):
        bt[i, :n] = ids[used : used + n]
        used += n
        slots += [int(bt[i, p // block_size]) * block_size + p % block_size
                  for p in range(ctx - q_len, ctx)]  # fmt: skip
        cu.append(cu[-1] + q_len)
    ctx = [c for _, c in seqs]
    meta = AttentionMetadata(
        all(q == 1 for q, _ in seqs), len(seqs), torch.tensor(slots), torch.tensor(cu).int(),
        torch.tensor(ctx).int(), bt, max(q for q, _ in seqs), max(ctx), cu, ctx,
    )  # fmt: skip
    t = cu[-1]
    q, k = (torch.randn(t, h, d, generator=gen) for h in (spec.num_heads, hkv))
    v = torch.randn(t, hkv, dv, generator=gen)
    return q, k, v, kc, vc, meta


def _sinks(spec, use):
    import torch

    if not use:
        return None
    return torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(7)) * 2


def _err(out, ref):
    if not out.isfinite().all():
        return float("inf")
    return (out - ref).abs().max().item()


def case_backend(spec, sinks, seqs, block_size=16):
    """TritonBackend.forward (store + kernel) vs TorchRefBackend on copies of the same caches."""
    from hf_paged.attention.torch_ref import TorchRefBackend
    from hf_paged.attention.triton_backend import TritonBackend

    q, k, v, kc, vc, meta = _paged(seqs, spec, block_size)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    s = _sinks(spec, sinks)
    out = TritonBackend().forward(q, k, v, kc, vc, meta, spec, sinks=s)
    ref = TorchRefBackend().forward(q, k, v, kc_ref, vc_ref, meta, spec, sinks=s)
    assert out.shape == (q.shape[0], spec.num_heads, spec.v_head_dim), out.shape
    return max(_err(out, ref), _err(kc, kc_ref), _err(vc, vc_ref))


def case_decode_split(spec, sinks, num_partitions, lens=DECODE_LENS):
    """Split-K decode (main kernel + reduce) vs the reference over the same cache."""
    from hf_paged.attention.torch_ref import TorchRefBackend
    from hf_paged.attention.triton_backend import TritonBackend
    from hf_paged.kernels.attention.paged_decode import paged_decode

    q, k, v, kc, vc, meta = _paged([(1, n) for n in lens], spec)
    s = _sinks(spec, sinks)
    ref = TorchRefBackend().forward(q, k, v, kc, vc, meta, spec, sinks=s)  # stores k/v
    slopes = TritonBackend()._alibi_slopes(spec, q.device)
    out = paged_decode(q, kc, vc, meta.block_tables, meta.context_lens, spec.scale,
                       spec.sliding_window, softcap=spec.softcap, alibi_slopes=slopes, sinks=s,
                       num_partitions=num_partitions)  # fmt: skip
    return _err(out, ref)


def case_decode_padding_rows(sinks):
    """CUDA-graph padding rows (context_len 0) give zeros with sinks, with and without split-K."""
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode

    spec = _spec(4, 2, 24, 16, softcap=3.0)
    q, _, _, kc, vc, meta = _paged([(1, 100), (1, 1)], spec)
    meta.context_lens[1] = 0
    err = 0.0
    for parts in (1, 3):
        out = paged_decode(q, kc, vc, meta.block_tables, meta.context_lens, spec.scale,
                           softcap=3.0, sinks=_sinks(spec, sinks), num_partitions=parts)  # fmt: skip
        err = max(err, _err(out[1], torch.zeros_like(out[1])))
    return err


SPECS = {  # name -> (spec args, sinks)
    "softcap": (dict(h=4, hkv=2, d=32, softcap=2.0), False),
    "softcap_window": (dict(h=4, hkv=2, d=32, softcap=2.0, window=20), False),
    "dv_lt_d_16_8": (dict(h=4, hkv=2, d=16, dv=8), False),
    "mla_192_128": (dict(h=2, hkv=1, d=192, dv=128), False),
    "d24": (dict(h=4, hkv=2, d=24), False),
    "alibi_gqa": (dict(h=4, hkv=2, d=16, alibi=True), False),
    "alibi_gqa_window": (dict(h=8, hkv=2, d=16, alibi=True, window=33), False),
    "sinks": (dict(h=4, hkv=2, d=16), True),
    "sinks_window": (dict(h=4, hkv=1, d=16, window=16), True),
    "all_d24_dv16": (dict(h=4, hkv=2, d=24, dv=16, softcap=3.0, alibi=True, window=25), True),
}
CASES = {"decode_padding_rows_sinks": (case_decode_padding_rows, (True,))}
for _name, (_kw, _sinks_on) in SPECS.items():
    _sp = _spec(**_kw)
    CASES[f"prefill_{_name}"] = (case_backend, (_sp, _sinks_on, PREFILL_SEQS))
    CASES[f"decode_{_name}"] = (case_backend, (_sp, _sinks_on, [(1, n) for n in DECODE_LENS]))
    CASES[f"decode_split3_{_name}"] = (case_decode_split, (_sp, _sinks_on, 3))
# every cached-prefix length mod the 32-key tile, window 25: each edge of the three key runs
SWEEP_SEQS = [(3, prefix + 3) for prefix in range(31, 65, 3)]
CASES["prefill_prefix_sweep_all"] = (case_backend, (_spec(**SPECS["all_d24_dv16"][0]), True,
                                                    SWEEP_SEQS))  # fmt: skip
# chunked prefill: the same prompt's later chunk over its cached first chunk, block size 8
CASES["prefill_chunked_all_bs8"] = (case_backend, (_spec(**SPECS["all_d24_dv16"][0]), True,
                                                   [(16, 48), (16, 16)], 8))  # fmt: skip




@pytest.mark.parametrize("case", sorted(CASES))
def test_triton_matches_torch_reference(interpreted, case):
    result = interpreted[case]
    assert result < TOL, f"{case}: max abs error {result}"


def _ref_out(spec, sinks, seqs):
    from hf_paged.attention.torch_ref import TorchRefBackend

    q, k, v, kc, vc, meta = _paged(seqs, spec)
    return TorchRefBackend().forward(q, k, v, kc, vc, meta, spec, sinks=sinks)


@pytest.mark.parametrize("seqs", [PREFILL_SEQS, [(1, n) for n in DECODE_LENS]])
@pytest.mark.parametrize("modifier", ["softcap", "alibi", "sinks", "window"])
def test_each_modifier_changes_the_reference(modifier, seqs):
    """Dropping any one modifier moves the oracle by >> TOL: the cases above have teeth."""
    kw = dict(h=4, hkv=2, d=24, dv=16, softcap=3.0, alibi=True, window=25)
    off = {"softcap": {"softcap": None}, "alibi": {"alibi": False}, "window": {"window": None}}
    spec, base = _spec(**kw), _spec(**dict(kw, **off.get(modifier, {})))
    with_sinks = _sinks(spec, True)
    full = _ref_out(spec, with_sinks, seqs)
    less = _ref_out(base, None if modifier == "sinks" else with_sinks, seqs)
    assert (full - less).abs().max().item() > 100 * TOL


def test_problem_accepts_the_generic_specs_and_names_the_rest():
    import torch

    pytest.importorskip("triton")
    from hf_paged.attention.triton_backend import TritonBackend

    backend, bf16 = TritonBackend(), torch.bfloat16
    for kw in (dict(h=8, hkv=4, d=256, softcap=50.0), dict(h=16, hkv=16, d=192, dv=128),
               dict(h=8, hkv=2, d=80, alibi=True), dict(h=8, hkv=8, d=96, window=128)):  # fmt: skip
        assert backend.problem(_spec(**kw), bf16, 16) is None, kw
    assert "head_dim=320" in backend.problem(_spec(4, 2, 320), bf16, 16)
    assert "head_dim_v=512" in backend.problem(_spec(4, 2, 128, 512), bf16, 16)
    assert "kv_block_size=12" in backend.problem(_spec(4, 2, 64), bf16, 12)
    assert backend.accepts_sinks and backend.supports_cuda_graph


if __name__ == "__main__":
    interpret_main(CASES)
