"""Beam search and beam sampling: stock ``generate`` vs ``generate(backend="paged")`` on a tiny
fp32 llama, stock in the same test.

``sequences`` and ``beam_indices`` must be identical, ``sequences_scores`` within 1e-5 (plus
1e-6 of the score: ``length_penalty=-1`` multiplies a sum of log-probs by the length), the
``scores`` tuple of stock's length and shapes (and close). The matrix covers every pair of
``num_beams`` x ``length_penalty`` x ``early_stopping`` (a Latin square, not the cross product),
``num_return_sequences`` 1 and ``num_beams``, EOS lists, left-padded batches of 3 to 5 prompts
(longer prompts are prefilled in chunks), and an engine whose KV cache is too small for the
batch's beams, so beams are preempted or parked and recomputed (asserted from ``engine.stats``).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from transformers import LogitsProcessor

from hf_paged.attention.kv_cache import KVCache, KVCacheSpec
from hf_paged.integration import dispatch
from hf_paged.integration.fallback import PagedFallbackWarning
from hf_paged.integration.prepare import prepare_call
from hf_paged.refusal import Refusal
from hf_paged.testing import build_hf_model

NEW = 10
ENGINE = dict(kv_block_size=4, max_num_batched_tokens=32, max_num_seqs=16, seed=0)
ROOMY = dict(ENGINE, num_kv_blocks=256)
# per num_beams, blocks of 4 tokens such that one row's beams fit (the fallback bound) but a
# batch's beams do not (16 is the fewest max_model_len=64 allows)
TIGHT = {k: dict(ENGINE, num_kv_blocks=n, max_model_len=64) for k, n in ((2, 16), (4, 24), (8, 40))}


@pytest.fixture(scope="module")
def models():
    """Copies of one tiny llama (same weights): a roomy engine and two tight ones."""
    built = {name: build_hf_model("llama", seed=0) for name in ("roomy", *TIGHT)}
    dispatch.configure(built["roomy"], **ROOMY)
    for num_beams, config in TIGHT.items():
        dispatch.configure(built[num_beams], **config)
    yield built
    for m in built.values():
        dispatch.release(m)


def left_pad(lengths, seed):
    """``(input_ids [B, L], attention_mask [B, L])``: random prompts, pad 0 on the left."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def eos_list(out: torch.Tensor, width: int) -> list[int]:
    """An EOS list of id 2 and two ids stock's best beams emit early without it, so beams
    really finish on them (``out``: stock's sequences, ``width``: the prompt's)."""
    return [2, int(out[0, width + 2]), int(out[-1, width + 4])]


@pytest.fixture(scope="module")
def eos_ids(models):
    ids, mask = left_pad([5, 9, 3, 7], seed=1)
    out = models["roomy"].generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
                                   num_beams=4)  # fmt: skip
    return eos_list(out, ids.shape[1])


def stock_and_paged(model, seed: int = 1234, **kwargs):
    """Both runs from the same global RNG state; a fallback warning fails the test."""
    torch.manual_seed(seed)
    stock = model.generate(**kwargs)
    torch.manual_seed(seed)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        paged = model.generate(**kwargs, backend="paged")
    fallbacks = [str(w.message) for w in records if issubclass(w.category, PagedFallbackWarning)]
    assert not fallbacks, fallbacks
    return stock, paged


def assert_same_beams(stock, paged) -> None:
    assert type(paged) is type(stock)
    assert torch.equal(paged.sequences, stock.sequences)
    assert torch.equal(paged.beam_indices, stock.beam_indices)
    if stock.sequences_scores is None:
        assert paged.sequences_scores is None
    else:
        torch.testing.assert_close(paged.sequences_scores, stock.sequences_scores, atol=1e-5,
                                   rtol=1e-6)  # fmt: skip
    if stock.scores is None:
        assert paged.scores is None
    else:
        assert [s.shape for s in paged.scores] == [s.shape for s in stock.scores]
        torch.testing.assert_close(torch.stack(paged.scores), torch.stack(stock.scores),
                                   atol=1e-4, rtol=1e-4)  # fmt: skip


def engine_stats(model) -> dict:
    return dispatch.get_engine(model).stats


# (num_beams, length_penalty, early_stopping): every pair of the three options once
LATIN = [
    (2, -1.0, True), (2, 0.0, False), (2, 1.5, "never"),
    (4, -1.0, False), (4, 0.0, "never"), (4, 1.5, True),
    (8, -1.0, "never"), (8, 0.0, True), (8, 1.5, False),
]  # fmt: skip
BATCHES = [[5, 9, 3], [4, 2, 12, 6], [3, 3, 8, 1, 6]]
CASES = [
    # (case, num_return_sequences "1" or "K", EOS list, KV budget)
    (i, "K" if i % 2 else "1", i % 3 != 1, "tight" if i in (1, 5, 6) else "roomy")
    for i in range(len(LATIN))
]


@pytest.mark.parametrize("case,nrs,eos,kv", CASES, ids=lambda v: str(v))
def test_beam_search_matrix_equals_stock(models, case, nrs, eos, kv):
    num_beams, length_penalty, early_stopping = LATIN[case]
    lengths = BATCHES[case % 3]
    ids, mask = left_pad(lengths, seed=case)
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=num_beams,
        length_penalty=length_penalty, early_stopping=early_stopping,
        num_return_sequences=num_beams if nrs == "K" else 1,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    model = models["roomy" if kv == "roomy" else num_beams]
    if eos:
        without = model.generate(**dict(kwargs, return_dict_in_generate=False))
        kwargs["eos_token_id"] = eos_list(without, ids.shape[1])
    before = engine_stats(model)
    stock, paged = stock_and_paged(model, **kwargs)
    assert_same_beams(stock, paged)
    assert paged.sequences.shape[0] == len(lengths) * kwargs["num_return_sequences"]
    if eos:  # the EOS list changed stock's beams
        assert not torch.equal(without, stock.sequences)
    if kv == "tight":
        after = engine_stats(model)
        recomputed = sum(after[k] - before[k] for k in ("num_preemptions", "num_parked"))
        assert recomputed > 0, after
    assert engine_stats(model)["num_free_blocks"] == engine_stats(model)["num_kv_blocks"]


class Boost(LogitsProcessor):
    """A user processor: records what it sees and moves one token up (so it changes beams)."""

    def __init__(self):
        self.calls = []

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        scores = scores.clone()
        scores[:, 7] += 1.5
        return scores


def test_processors_logits_and_user_processor_see_what_stock_gives_them(models, eos_ids):
    ids, mask = left_pad([6, 2, 9], seed=7)
    procs = {"stock": Boost(), "paged": Boost()}
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=4,
        num_return_sequences=2, eos_token_id=eos_ids, min_new_tokens=4,
        bad_words_ids=[[eos_ids[1]], [9, 10]], repetition_penalty=1.3, no_repeat_ngram_size=2,
        return_dict_in_generate=True, output_scores=True, output_logits=True,
    )  # fmt: skip
    model = models["roomy"]
    torch.manual_seed(0)
    stock = model.generate(**kwargs, logits_processor=[procs["stock"]])
    paged = model.generate(**kwargs, logits_processor=[procs["paged"]], backend="paged")
    assert_same_beams(stock, paged)
    torch.testing.assert_close(torch.stack(paged.logits), torch.stack(stock.logits), atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    assert len(procs["paged"].calls) == len(procs["stock"].calls) == len(stock.scores)
    for (pi, ps), (si, ss) in zip(procs["paged"].calls, procs["stock"].calls, strict=True):
        assert torch.equal(pi, si)  # [B * num_beams, cur_len]: every beam, pads included
        torch.testing.assert_close(ps, ss, atol=1e-4, rtol=1e-4)


def test_an_error_mid_call_leaves_the_engine_clean(models):
    class Fails(LogitsProcessor):
        calls = 0

        def __call__(self, input_ids, scores):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("processor failed")
            return scores

    model = models[4]  # tight: some beams are parked or preempted when it fails
    ids, mask = left_pad([5, 9, 3, 12, 7], seed=4)
    with pytest.raises(RuntimeError, match="processor failed"):
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=4,
                       logits_processor=[Fails()], backend="paged")  # fmt: skip
    engine = dispatch.get_engine(model)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.runtime.num_kv_blocks
    stock, paged = stock_and_paged(model, input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                   num_beams=4)  # fmt: skip
    assert torch.equal(paged, stock)  # and it serves the next call


def test_plain_tensor_and_dict_without_scores(models):
    ids, mask = left_pad([4, 7, 2], seed=3)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=3)
    stock, paged = stock_and_paged(models["roomy"], **kwargs)
    assert isinstance(paged, torch.Tensor) and torch.equal(paged, stock)
    stock, paged = stock_and_paged(models["roomy"], return_dict_in_generate=True, **kwargs)
    assert paged.sequences_scores is None and paged.scores is None and paged.logits is None
    assert_same_beams(stock, paged)


@pytest.mark.parametrize("num_beams,temperature,top_k", [(2, 1.0, 0), (4, 0.7, 20)])
def test_beam_sampling_with_a_seed_repeats_stocks_draws(models, num_beams, temperature, top_k):
    """Beam sampling draws one multinomial over [B, num_beams * V] per step from torch's global
    RNG, in stock's own helper, and nothing else draws: with the same seed on the same device
    the draws are stock's, and so are the beams while the logits agree as closely as here."""
    ids, mask = left_pad([5, 9, 3, 7], seed=11)
    kwargs = dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_beams=num_beams,
        do_sample=True, temperature=temperature, top_k=top_k, num_return_sequences=2,
        return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    model = models["roomy"]
    for seed in (0, 1):
        stock, paged = stock_and_paged(model, seed=seed, **kwargs)
        assert_same_beams(stock, paged)
        # valid beams by their own account: each score is its tokens' summed processed
        # log-probs (traced back through beam_indices) over length ** length_penalty
        steps = model.compute_transition_scores(
            paged.sequences, paged.scores, paged.beam_indices, normalize_logits=False
        )
        lengths = (paged.beam_indices >= 0).sum(dim=1)
        torch.testing.assert_close(steps.sum(dim=1) / lengths, paged.sequences_scores,
                                   atol=1e-4, rtol=1e-5)  # fmt: skip
    torch.manual_seed(0)
    first = model.generate(**kwargs, backend="paged")
    torch.manual_seed(1)
    other = model.generate(**kwargs, backend="paged")
    assert not torch.equal(first.sequences, other.sequences)  # it does sample


def test_rows_that_can_no_longer_change_leave_the_engine(models, monkeypatch):
    """early_stopping=True and EOS ids that some rows' beams emit early: rows finish at
    different steps; the engine stops computing a finished row (no one observes it) and the
    beams are still stock's."""
    model = models["roomy"]
    ids, mask = left_pad([5, 9, 3, 7, 4], seed=2)
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=16, num_beams=2,
                  early_stopping=True, num_return_sequences=2)  # fmt: skip
    out, width = model.generate(**kwargs), ids.shape[1]
    kwargs["eos_token_id"] = sorted({int(out[2 * r, width + 1 + 2 * r]) for r in range(3)})
    engine = dispatch.get_engine(model)
    rows_per_call = []
    provide = engine.provide_beams

    def recording(request_ids, parents, token_ids):
        rows_per_call.append(len(request_ids))
        return provide(request_ids, parents, token_ids)

    monkeypatch.setattr(engine, "provide_beams", recording)
    stock, paged = stock_and_paged(model, **kwargs)
    assert torch.equal(paged, stock)
    assert rows_per_call[0] == 5 and min(rows_per_call) < 5, rows_per_call


def test_what_stays_stock(models):
    model = models["roomy"]
    ids, mask = left_pad([4, 6], seed=5)
    base = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
    for kwargs in (dict(base, low_memory=True),):  # stock refuses it; so does the paged call
        with pytest.raises(ValueError, match="low_memory"):
            model.generate(**kwargs)
        with pytest.warns(PagedFallbackWarning, match=r"\[low_memory\]"):
            with pytest.raises(ValueError, match="low_memory"):
                model.generate(**kwargs, backend="paged")
    # group and constrained beams are hub custom_generate code in v5: stock, by name
    for extra, reason in (
        (dict(num_beam_groups=2, diversity_penalty=0.5), "group_beam_search"),
        (dict(force_words_ids=[[5]]), "constrained_beam_search"),
    ):
        refusal = prepare_call(model, **base, **extra)
        assert isinstance(refusal, Refusal) and refusal.reason == reason
    # one row's beams do not fit the tight engine at all: stock runs it
    tight = models[8]
    big = dict(base, num_beams=8, max_new_tokens=40)
    torch.manual_seed(0)
    stock = tight.generate(**big)
    with pytest.warns(PagedFallbackWarning, match=r"\[kv_cache\]"):
        paged = tight.generate(**big, backend="paged")
    assert torch.equal(paged, stock)


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# Beam search on one GPU: the Triton attention kernels (KV blocks of 16) and decode CUDA graphs
# with forked, copy-on-write blocks, against stock ``generate`` on the same fp32 model; seeded beam
# sampling against stock's draws on the CUDA generator; the block copy on CUDA tensors.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


CUDA_ENGINE = dict(kv_block_size=16, max_num_batched_tokens=256, max_num_seqs=32, seed=0,
              max_model_len=128, device="cuda")  # fmt: skip


@pytest.fixture(scope="module", params=["roomy", "tight"])
def cuda_model(request):
    """fp32 llama on CUDA; "tight": 16 blocks, less than the batch's beams need at once."""
    m = build_hf_model("llama", seed=0).cuda()
    dispatch.configure(m, **CUDA_ENGINE, num_kv_blocks=256 if request.param == "roomy" else 16)
    yield m
    dispatch.release(m)


def cuda_left_pad(lengths, seed):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device="cuda")
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device="cuda")
    return ids, mask


def cuda_both(cuda_model, seed=0, **kwargs):
    torch.manual_seed(seed)
    stock = cuda_model.generate(**kwargs)
    # the stock call gave the CUDA engine back (engine_owner): start it before seeding, so the
    # paged call's draws start where stock's did whatever the engine's start does
    dispatch.get_engine(cuda_model)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        paged = cuda_model.generate(**kwargs, backend="paged")
    return stock, paged


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("do_sample", [False, True], ids=["beam_search", "beam_sample"])
def test_beams_on_cuda_equal_stock(cuda_model, do_sample):
    ids, mask = cuda_left_pad([15, 16, 17, 40], seed=3)  # prompts end inside and at block edges
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, num_beams=4,
                  num_return_sequences=2, do_sample=do_sample, return_dict_in_generate=True,
                  output_scores=True)  # fmt: skip
    stock, paged = cuda_both(cuda_model, **kwargs)
    assert torch.equal(paged.sequences, stock.sequences)
    assert torch.equal(paged.beam_indices, stock.beam_indices)
    torch.testing.assert_close(paged.sequences_scores, stock.sequences_scores, atol=1e-4,
                               rtol=1e-5)  # fmt: skip
    assert [s.shape for s in paged.scores] == [s.shape for s in stock.scores]
    stats = dispatch.get_engine(cuda_model).stats
    assert stats["num_copied_blocks"] > 0
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    if stats["num_kv_blocks"] == 16:
        assert stats["num_preemptions"] + stats["num_parked"] > 0


@pytest.mark.gpu
@needs_cuda
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
