"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged.testing import save_tiny_model


@pytest.fixture(scope="module")
def logprob_model(tmp_path_factory):
    """An untied tiny qwen3 checkpoint and its stock HF model (fp32), for the prompt-logprob
    tests."""
    path = str(tmp_path_factory.mktemp("plp"))
    save_tiny_model("qwen3", path, seed=0, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf
