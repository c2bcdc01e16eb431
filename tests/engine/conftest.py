"""Fixtures of the engine tests (``tests/engine`` and its rooms ``core/``, ``worker/``,
``spec/``): the prompt-logprob model, and the tiny models the speculative-decoding tests share (a
target, a draft close to it, one far from it). A test marked ``gpu`` skips without CUDA."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged.testing import build_hf_model, save_tiny_model


def pytest_runtest_setup(item):
    """Hardware is a marker: a ``gpu`` test of these folders skips cleanly without CUDA."""
    if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA (marker gpu)")


@pytest.fixture(scope="module")
def logprob_model(tmp_path_factory):
    """An untied tiny qwen3 checkpoint and its stock HF model (fp32), for the prompt-logprob
    tests."""
    path = str(tmp_path_factory.mktemp("plp"))
    save_tiny_model("qwen3", path, seed=0, tie_word_embeddings=False)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, hf


@pytest.fixture(autouse=True, scope="module")
def _engine_threads(one_thread):
    """``one_thread`` (tests/conftest.py) for every engine test module."""
    yield


def save_perturbed(path, family: str, seed: int, noise: float, **overrides) -> str:
    """``build_hf_model(family, seed)`` with ``noise`` * N(0, 1) added to every weight, saved to
    ``path``: a draft model that agrees with the unperturbed one often, not always."""
    model = build_hf_model(family, seed, **overrides)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    """Checkpoint dirs: ``target`` (llama, seed 0), ``near`` (the target perturbed: drafts that
    are kept often), ``far`` (another 1-layer llama: drafts rarely kept); and the target as an
    HF model for stock ``generate``."""
    root = tmp_path_factory.mktemp("spec")
    paths = {
        "target": save_perturbed(root / "target", "llama", 0, 0.0),
        "near": save_perturbed(root / "near", "llama", 0, 0.03),
        "far": save_perturbed(root / "far", "llama", 7, 0.0, num_hidden_layers=1),
    }
    return paths, build_hf_model("llama", 0)
