"""The pipeline's per-batch ``generate`` keywords: ``KwargsCache`` gives, for every batch of a
call, exactly what a fresh capture of the pipeline's own ``_forward`` gives (tensors equal, the
same keys and option values), whatever the options: a user generation config, a prefix, padded
and unpadded batches, a last batch of another size, an empty prompt."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import GenerationConfig
from transformers.pipelines.base import pad_collate_fn

import hf_paged  # noqa: F401
from hf_paged.integration.pipeline.capture import KwargsCache, capture_generate_kwargs

pytestmark = pytest.mark.usefixtures("pipeline_wrapper")

TEXTS = ["Hello, my name is", "ab", "The capital of France is", "def fib(n):", "x y z"]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor) or isinstance(b[k], torch.Tensor):
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], GenerationConfig):
            assert a[k].to_dict() == b[k].to_dict(), k
        else:
            assert a[k] == b[k], k


def _batches(pipe, texts, batch_size, preprocess_params):
    items = [pipe.preprocess(t, **preprocess_params) for t in texts]
    collate = pad_collate_fn(pipe.tokenizer, None)
    return [collate(items[i : i + batch_size]) for i in range(0, len(items), batch_size)]


@pytest.mark.parametrize(
    "call",
    [
        dict(max_new_tokens=5, do_sample=False),
        dict(max_new_tokens=5, do_sample=True, temperature=0.7, top_k=3),
        dict(generation_config=GenerationConfig(max_new_tokens=4, num_beams=2), num_beams=2),
        dict(max_length=30, prefix="Once upon a time "),
        dict(max_new_tokens=3, return_full_text=False, stop_strings=["x"]),
    ],
    ids=["greedy", "sampled", "user-config", "prefix", "stop-strings"],
)
@pytest.mark.parametrize("batch_size", [1, 2])
def test_cached_keywords_equal_a_fresh_capture(ckpt, call, batch_size):
    pipe = transformers.pipeline("text-generation", model=ckpt, device="cpu")
    pre, fwd, _ = pipe._sanitize_parameters(**call)
    cache = KwargsCache(pipe, fwd)
    for batch in _batches(pipe, TEXTS, batch_size, pre):
        _same(cache.get(batch), capture_generate_kwargs(pipe, batch, fwd))
    assert len(cache._captured) <= 2  # one per shape class: the last batch may be smaller


def test_an_empty_prompt_is_captured_on_its_own(ckpt):
    pipe = transformers.pipeline("text-generation", model=ckpt, device="cpu")
    pre, fwd, _ = pipe._sanitize_parameters(max_new_tokens=2)
    cache = KwargsCache(pipe, fwd)
    empty = pipe.preprocess("", **pre)
    full = pipe.preprocess("ab", **pre)
    for batch in (empty, full, empty, full):
        _same(cache.get(batch), capture_generate_kwargs(pipe, batch, fwd))
