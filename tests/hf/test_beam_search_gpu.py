"""Beam search on one GPU: the Triton attention kernels (KV blocks of 16) and decode CUDA graphs
with forked, copy-on-write blocks, against stock ``generate`` on the same fp32 model; seeded beam
sampling against stock's draws on the CUDA generator; the block copy on CUDA tensors."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from hf_paged.attention.kv_cache import KVCache, KVCacheSpec
from hf_paged.integration import dispatch
from hf_paged.integration.fallback import PagedFallbackWarning
from hf_paged.testing import build_hf_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

ENGINE = dict(kv_block_size=16, max_num_batched_tokens=256, max_num_seqs=32, seed=0,
              max_model_len=128, device="cuda")  # fmt: skip


@pytest.fixture(scope="module", params=["roomy", "tight"])
def model(request):
    """fp32 llama on CUDA; "tight": 16 blocks, less than the batch's beams need at once."""
    m = build_hf_model("llama", seed=0).cuda()
    dispatch.configure(m, **ENGINE, num_kv_blocks=256 if request.param == "roomy" else 16)
    yield m
    dispatch.release(m)


def left_pad(lengths, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    return ids, mask


def both(model, seed=0, **kwargs):
    torch.manual_seed(seed)
    stock = model.generate(**kwargs)
    # the stock call gave the CUDA engine back (engine_owner): start it before seeding, so the
    # paged call's draws start where stock's did whatever the engine's start does
    dispatch.get_engine(model)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = model.generate(**kwargs, backend="paged")
    return stock, paged


@pytest.mark.parametrize("do_sample", [False, True], ids=["beam_search", "beam_sample"])
def test_beams_on_cuda_equal_stock(model, do_sample):
    ids, mask = left_pad([15, 16, 17, 40], seed=3)  # prompts end inside and at block edges
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, num_beams=4,
                  num_return_sequences=2, do_sample=do_sample, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    stock, paged = both(model, **kwargs)
    assert torch.equal(paged.sequences, stock.sequences)
    assert torch.equal(paged.beam_indices, stock.beam_indices)
    torch.testing.assert_close(paged.sequences_scores, stock.sequences_scores, atol=1e-4,
                               rtol=1e-5)  # fmt: skip
    assert [s.shape for s in paged.scores] == [s.shape for s in stock.scores]
    stats = dispatch.get_engine(model).stats
    assert stats["num_copied_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    if stats["num_kv_blocks"] == 16:
        assert stats["num_preemptions"] + stats["num_parked"] > 0


def test_copy_blocks_on_cuda():
    cache = KVCache([KVCacheSpec(2, 64, 64)] * 2, 8, 16, torch.bfloat16, "cuda")
    for t in cache.storage:
        t.normal_()
    before = [t.clone() for t in cache.storage]
    cache.copy_blocks([(1, 5), (5, 2)])
    for t, b in zip(cache.storage, before, strict=True):
        assert torch.equal(t[:, :, 5], b[:, :, 1]) and torch.equal(t[:, :, 2], b[:, :, 5])
        keep = [i for i in range(8) if i not in (2, 5)]
        assert torch.equal(t[:, :, keep], b[:, :, keep])
