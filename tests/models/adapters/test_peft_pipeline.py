"""The pipeline passes PEFT's ``adapter_names`` through its ``generate_kwargs``: a paged pipeline
over a PEFT model with several adapters equals the stock pipeline, call by call, and serves it
(no fallback)."""

from __future__ import annotations

import warnings

import pytest

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from hf_paged import PagedFallbackWarning  # noqa: E402
from hf_paged.testing import SMALL_ENGINE, build_hf_model, tiny_tokenizer  # noqa: E402
from hf_paged.testing.models import randomize_lora_  # noqa: E402


def test_pipeline_passes_adapter_names():
    import transformers

    from hf_paged.integration.pipeline import install_pipeline

    install_pipeline()
    model = get_peft_model(
        build_hf_model("llama"),
        LoraConfig(r=4, target_modules=["q_proj", "down_proj"]),
        adapter_name="one",
    )
    model.add_adapter("two", LoraConfig(r=2, target_modules=["v_proj", "up_proj"]))
    randomize_lora_(model, seed=0).eval()
    tok = tiny_tokenizer()
    greedy = dict(max_new_tokens=10, do_sample=False)
    stock = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu")
    paged = transformers.pipeline("text-generation", model=model, tokenizer=tok, device="cpu",
                                  backend="paged", paged_config=SMALL_ENGINE)  # fmt: skip
    texts = ["Hello, my name is", "def fib(n):"]
    outs = []
    for names in (["one"], ["two"], ["__base__"]):
        want = stock(texts, batch_size=1, adapter_names=names, **greedy)
        with warnings.catch_warnings():
            warnings.simplefilter("error", PagedFallbackWarning)
            got = paged(texts, batch_size=1, adapter_names=names, **greedy)
        assert got == want
        outs.append(got)
    assert outs[0] != outs[1] != outs[2]
