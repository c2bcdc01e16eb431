"""fp8 KV cache in the Triton kernels under the CPU interpreter: the store kernel clamps and
rounds like the torch reference, and paged decode / prefill over float8 caches equal their
references over the same caches read back in the query dtype. Runs as a child process
(tests/kernels/interpret_utils.py)."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main


def _caches(num_blocks=8, block=8, kv_heads=2, d=32, seed=0):
    import torch

    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(num_blocks, block, kv_heads, d, generator=g) * 2).to(torch.float8_e4m3fn)
    v = (torch.randn(num_blocks, block, kv_heads, d, generator=g) * 2).to(torch.float8_e4m3fn)
    return k, v


def _store_case():
    import torch

    from hf_paged.kernels.attention.kv_store import store_kvcache, store_kvcache_ref

    g = torch.Generator().manual_seed(1)
    k = torch.randn(6, 2, 32, generator=g) * 100  # some values past e4m3's 448: clamped
    v = torch.randn(6, 2, 32, generator=g)
    slots = torch.tensor([0, 9, -1, 17, 30, 63])
    caches = [torch.zeros(8, 8, 2, 32, dtype=torch.float8_e4m3fn) for _ in range(4)]
    store_kvcache(k, v, caches[0], caches[1], slots)
    store_kvcache_ref(k, v, caches[2], caches[3], slots)
    same = [(a.float() == b.float()).float().mean().item() for a, b in zip(caches[:2], caches[2:])]
    assert not torch.isnan(caches[0].float()).any()
    return min(same)


def _decode_case():
    import torch

    from hf_paged.kernels.attention.paged_decode import paged_decode, paged_decode_ref

    k, v = _caches()
    q = torch.randn(3, 4, 32, generator=torch.Generator().manual_seed(2))
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 0, 0], [6, 7, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([29, 11, 16], dtype=torch.int32)
    out = paged_decode(q, k, v, tables, lens, 0.2, num_partitions=2)
    ref = paged_decode_ref(q, k.float(), v.float(), tables, lens, 0.2)
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _prefill_case():
    import torch

    from hf_paged.kernels.attention.paged_prefill import paged_prefill, paged_prefill_ref

    k, v = _caches()
    q = torch.randn(20, 4, 32, generator=torch.Generator().manual_seed(3))
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)
    cu = torch.tensor([0, 12, 20], dtype=torch.int32)  # 12 new over 18 cached, 8 new
    lens = torch.tensor([30, 8], dtype=torch.int32)
    out = paged_prefill(q, k, v, tables, cu, lens, 12, 0.2)
    ref = paged_prefill_ref(q, k.float(), v.float(), tables, cu, lens, 0.2)
    return ((out - ref).abs().max() / ref.abs().max()).item()


CASES = {"store": (_store_case, ()), "decode": (_decode_case, ()),
         "prefill": (_prefill_case, ())}  # fmt: skip




def test_store_into_fp8_cache(interpreted):
    value = interpreted["store"]
    assert value > 0.97  # the interpreter's float8 cast drops rare binade carries (see
    # tests/kernels/test_fp8_interpret.py); on CUDA both round alike


@pytest.mark.parametrize("name", ["decode", "prefill"])
def test_attention_over_fp8_cache(interpreted, name):
    value = interpreted[name]
    assert value < 1e-4, f"{name}: relative error {value}"


if __name__ == "__main__":
    interpret_main(CASES)
