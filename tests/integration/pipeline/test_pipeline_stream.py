"""A paged pipeline over a list, a KeyDataset or a generator is ONE engine run: outputs equal the
stock pipeline's (greedy), the engine ran more sequences at once than ``batch_size``, a generator
stays lazy, and what the engine can't sample itself takes the per-batch path."""

from __future__ import annotations

import gc

import pytest
import torch
import transformers
from transformers import StoppingCriteria
from transformers.pipelines.pt_utils import KeyDataset

import hf_paged  # noqa: F401  (installs the dispatcher and the pipeline wrapper)
from hf_paged.integration import dispatch, route
from hf_paged.testing import save_checkpoint
from tests.integration.pipe_utils import CHAT, GREEDY, PROMPTS

# transformers.pipeline patched for the whole module (conftest.py has the fixtures)
pytestmark = pytest.mark.usefixtures("pipeline_wrapper")

# 16 sequences at once (> the batch sizes below), 4-token blocks, chunked prefill
ENGINE = dict(
    device="cpu", num_kv_blocks=256, kv_block_size=4, max_num_seqs=16, max_num_batched_tokens=64
)
MANY = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(64)]


@pytest.fixture(scope="module")
def stock_many(stock_pipe):
    """Stock's outputs for MANY, by batch size (computed once)."""
    return {bs: stock_pipe(MANY, batch_size=bs, **GREEDY) for bs in (1, 8)}


@pytest.fixture
def paged_pipe(ckpt):
    """A fresh engine per test, so its stats count this test's calls only."""
    pipe = transformers.pipeline(
        "text-generation", model=ckpt, backend="paged", paged_config=ENGINE, device="cpu"
    )
    yield pipe
    pipe.model.close()


def _no_leaks(engine) -> None:
    assert not engine.has_unfinished_requests()
    assert engine.stats["num_free_blocks"] == engine.stats["num_kv_blocks"]


# ---- acceptance: one engine run, outputs equal stock's ------------------------------------------


@pytest.mark.parametrize("batch_size", [1, 8])
def test_list_of_64_is_one_engine_run(paged_pipe, stock_many, counter, batch_size, monkeypatch):
    prepared = []
    real = route.prepare_call
    monkeypatch.setattr(route, "prepare_call", lambda *a, **k: prepared.append(1) or real(*a, **k))
    out = paged_pipe(MANY, batch_size=batch_size, **GREEDY)
    # unpadded rows with max_new_tokens share one preparation; padded batches each have their own
    assert len(prepared) == (1 if batch_size == 1 else 8)
    assert out == stock_many[batch_size]
    assert len({r[0]["generated_text"] for r in out}) > 32  # the rows differ: a real check
    stats = paged_pipe.model.engine.stats
    assert stats["max_num_running_seqs"] > batch_size
    assert counter.calls == 0  # no per-batch generate call
    assert counter.streamed == 64 // batch_size  # every batch came back from the engine run
    _no_leaks(paged_pipe.model.engine)


def test_key_dataset_is_one_engine_run(paged_pipe, stock_many, counter, hf_datasets):
    ds = hf_datasets.Dataset.from_dict({"text": MANY})
    out = paged_pipe(KeyDataset(ds, "text"), batch_size=8, **GREEDY)
    assert not isinstance(out, list)  # lazy, as stock's
    assert list(out) == stock_many[8]
    assert paged_pipe.model.engine.stats["max_num_running_seqs"] > 8
    assert counter.calls == 0


def test_loaded_model_streams_through_its_dispatcher_engine(stock_pipe, stock_many, counter):
    model = stock_pipe.model
    pipe = transformers.pipeline(
        "text-generation", model=model, tokenizer=stock_pipe.tokenizer, backend="paged",
        paged_config=ENGINE, device="cpu",
    )  # fmt: skip
    try:
        assert pipe(MANY, batch_size=8, **GREEDY) == stock_many[8]
        engine = dispatch.get_engine(model, ENGINE)
        assert engine.stats["max_num_running_seqs"] > 8
        assert counter.calls == 0
        assert pipe(MANY[:3], backend="hf", **GREEDY) == stock_many[1][:3]  # a call may opt out
        assert counter.calls == 0
    finally:
        dispatch.release(model)


# ---- generators, chats, options ---------------------------------------------------------------


def test_generator_in_generator_out_lazily(paged_pipe, stock_many):
    pulled = []

    def prompts():
        for p in MANY * 4:
            pulled.append(p)
            yield p

    out = paged_pipe(prompts(), batch_size=2, **GREEDY)
    assert not isinstance(out, list)  # an iterator, as stock's
    it = iter(out)
    first = next(it)
    window = 4 * ENGINE["max_num_seqs"]  # the stream's bound on requests in flight
    assert len(pulled) <= window + 2 + 1  # + one batch being prepared + stock's peek
    rest = [next(it) for _ in range(19)]
    assert [first, *rest] == stock_many[8][:20]
    assert paged_pipe.model.engine.has_unfinished_requests()
    del out, it  # abandoning it aborts the requests still in flight
    gc.collect()
    _no_leaks(paged_pipe.model.engine)
    assert paged_pipe(MANY[:2], **GREEDY) == stock_many[1][:2]  # and the engine works on


def test_chats_full_text_off_prefix_and_tensors(paged_pipe, stock_pipe, counter):
    chats = [CHAT, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "He"}]]
    cases = [
        (chats * 3, dict(batch_size=2)),
        (MANY[:6], dict(batch_size=3, return_full_text=False)),
        (MANY[:6], dict(batch_size=2, prefix="Once: ")),
        (MANY[:5], dict(batch_size=4, return_tensors=True)),  # left pads included, as stock
    ]
    for inputs, kw in cases:
        assert paged_pipe(inputs, **kw, **GREEDY) == stock_pipe(inputs, **kw, **GREEDY), kw
    assert counter.calls == 0


def test_per_call_stop_strings_and_lengths(paged_pipe, stock_pipe, counter):
    ids = stock_pipe(MANY[0], return_tensors=True, **GREEDY)[0]["generated_token_ids"]
    stop = stock_pipe.tokenizer.decode(ids[len(MANY[0]) + 2])  # the first row's 3rd new token
    kw = dict(stop_strings=[stop], tokenizer=stock_pipe.tokenizer, max_new_tokens=12,
              do_sample=False)  # fmt: skip
    out = paged_pipe(MANY[:8], batch_size=1, **kw)
    assert out == stock_pipe(MANY[:8], batch_size=1, **kw)
    assert out[0][0]["generated_text"].endswith(stop)
    kw = dict(max_new_tokens=3, min_new_tokens=2, do_sample=False)
    assert paged_pipe(MANY[:8], batch_size=4, **kw) == stock_pipe(MANY[:8], batch_size=4, **kw)
    kw = dict(max_length=len(MANY[7]) + 2, do_sample=False)  # absolute: budgets differ by row
    out = paged_pipe(MANY[:8], **kw)
    assert out == stock_pipe(MANY[:8], **kw)
    ids = [r[0]["generated_token_ids"] for r in paged_pipe(MANY[:8], return_tensors=True, **kw)]
    assert [len(t) for t in ids] == [max(kw["max_length"], len(p) + 1) for p in MANY[:8]]
    assert counter.calls == 0


def test_sampled_rows_match_the_per_batch_path(paged_pipe):
    # the plain pipeline class on the same model: one paged generate call per batch
    per_batch = transformers.pipeline(
        "text-generation", model=paged_pipe.model, tokenizer=paged_pipe.tokenizer
    )
    assert type(per_batch) is not type(paged_pipe)
    kw = dict(do_sample=True, num_return_sequences=2, max_new_tokens=6, top_k=20)
    for batch_size in (1, 3):
        torch.manual_seed(0)
        streamed = paged_pipe(MANY[:6], batch_size=batch_size, **kw)
        torch.manual_seed(0)
        assert streamed == per_batch(MANY[:6], batch_size=batch_size, **kw)  # same seeds
        assert all(len(r) == 2 for r in streamed)
        assert len({r[i]["generated_text"] for r in streamed for i in (0, 1)}) > 6


class _Never(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        return torch.zeros(input_ids.shape[0], dtype=torch.bool)


def test_what_the_engine_cannot_sample_takes_the_per_batch_path(paged_pipe, stock_pipe, counter):
    kw = dict(batch_size=2, stopping_criteria=[_Never()], **GREEDY)
    assert paged_pipe(MANY[:5], **kw) == stock_pipe(MANY[:5], **kw)
    assert counter.calls == 3  # batches of 2, 2, 1: each its own (external-sampling) call


# ---- errors -----------------------------------------------------------------------------------


def test_bad_row_in_the_middle_raises_in_order_and_frees_the_engine(paged_pipe, stock_pipe):
    def rows():
        yield from MANY[:10]
        yield 7  # not a string: the tokenizer step fails on it
        yield from MANY[10:20]

    got, errors = [], []
    for pipe in (paged_pipe, stock_pipe):
        out, mine = pipe(rows(), batch_size=1, **GREEDY), []
        with pytest.raises(Exception) as info:
            for r in out:
                mine.append(r)
        got.append(mine)
        errors.append(info.value)
    assert got[0] == got[1] and len(got[0]) == 10  # every row before the bad one, as stock
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    _no_leaks(paged_pipe.model.engine)
    assert paged_pipe(MANY[:3], **GREEDY) == stock_pipe(MANY[:3], **GREEDY)


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_input_generator_interrupted_returns_the_rows_before_it(paged_pipe, stock_pipe, exc):
    # the engine pulls rows ahead of what it returned: a KeyboardInterrupt / SystemExit out of
    # the generator once aborted the rows before it, which stock's loop had returned already
    def rows():
        yield from MANY[:6]
        raise exc

    got = []
    for pipe in (paged_pipe, stock_pipe):
        mine = []
        with pytest.raises(exc):
            for r in pipe(rows(), batch_size=1, **GREEDY):
                mine.append(r)
        got.append(mine)
    assert got[0] == got[1] and len(got[0]) == 6
    _no_leaks(paged_pipe.model.engine)


def test_bad_generation_options_raise_stock_error(paged_pipe, stock_pipe):
    with pytest.raises(ValueError) as stock_err:
        stock_pipe(MANY[:3], max_new_tokens=-1)
    with pytest.raises(ValueError) as paged_err:
        paged_pipe(MANY[:3], max_new_tokens=-1)
    assert str(paged_err.value) == str(stock_err.value)
    _no_leaks(paged_pipe.model.engine)


def test_generate_inside_an_open_stream_is_a_clear_error(paged_pipe):
    it = iter(paged_pipe(iter_prompts(8), **GREEDY))
    next(it)
    with pytest.raises(RuntimeError, match="still iterating a pipeline over this model"):
        paged_pipe(MANY[0], **GREEDY)
    del it
    gc.collect()
    _no_leaks(paged_pipe.model.engine)
    assert paged_pipe(MANY[0], **GREEDY)  # usable again


def iter_prompts(n: int):
    yield from MANY[:n]


def test_a_paged_process_default_streams_a_plain_pipeline(stock_pipe, stock_many, counter):
    model = stock_pipe.model
    dispatch.set_default_backend("paged")  # as HF_PAGED_BACKEND=paged / hf-paged run
    dispatch.configure(model, **ENGINE)
    try:
        pipe = transformers.pipeline("text-generation", model=model, tokenizer=stock_pipe.tokenizer)
        assert pipe(MANY, batch_size=8, **GREEDY) == stock_many[8]
        assert dispatch.get_engine(model).stats["max_num_running_seqs"] > 8
        assert (counter.calls, counter.streamed) == (0, 8)
    finally:
        dispatch.set_default_backend(None)
        dispatch.release(model)


def test_a_pipeline_from_the_stock_factory_streams_with_backend_paged(stock_pipe, stock_many,
                                                                      counter):  # fmt: skip
    """A program that took ``transformers.pipeline`` before ``import hf_paged`` builds a plain
    ``TextGenerationPipeline``; with ``backend="paged"`` its many-input calls still stream, and
    without it they stay stock."""
    model = stock_pipe.model
    stock_factory = transformers.pipeline.__hf_paged_original__
    dispatch.configure(model, **ENGINE)
    try:
        pipe = stock_factory("text-generation", model=model, tokenizer=stock_pipe.tokenizer,
                             backend="paged")  # fmt: skip
        assert type(pipe) is transformers.TextGenerationPipeline
        assert pipe(MANY, batch_size=1, **GREEDY) == stock_many[1]
        assert dispatch.get_engine(model).stats["max_num_running_seqs"] > 8
        assert (counter.calls, counter.streamed) == (0, 64)
        plain = stock_factory("text-generation", model=model, tokenizer=stock_pipe.tokenizer)
        assert plain(MANY[:3], batch_size=1, **GREEDY) == stock_many[1][:3]
        assert (counter.calls, counter.streamed) == (0, 64)  # stock: nothing went paged
    finally:
        dispatch.release(model)


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# A paged pipeline over a list on one GPU (CUDA graphs, Triton backend): fp32 greedy outputs
# equal the stock pipeline's, and the prompts ran concurrently in one engine run.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


CUDA_PROMPTS = [f"{w} {i}" for i, w in enumerate(["Hello, my name is", "ab", "def fib(n):"] * 16)]


@pytest.fixture(scope="module")
def cuda_ckpt(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("pipe_gpu")), family="qwen3")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch_size", [1, 8])
def test_pipeline_list_equals_stock_on_cuda(cuda_ckpt, batch_size):
    kw = dict(max_new_tokens=16, do_sample=False, batch_size=batch_size)
    stock = transformers.pipeline(
        "text-generation", model=cuda_ckpt, device="cuda", dtype=torch.float32
    )
    want = stock(CUDA_PROMPTS, **kw)
    del stock
    pipe = transformers.pipeline(
        "text-generation", model=cuda_ckpt, backend="paged", device="cuda", dtype=torch.float32,
        paged_config={"max_num_seqs": 32},
    )  # fmt: skip
    try:
        assert pipe(CUDA_PROMPTS, **kw) == want
        stats = pipe.model.engine.stats
        assert stats["max_num_running_seqs"] > batch_size
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    finally:
        pipe.model.close()
