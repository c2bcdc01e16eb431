"""Fixtures for the engine tests: one torch thread, and the tiny models the speculative-decoding
tests share (a target, a draft close to it, and the char-vocabulary shape they all have)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.testing import build_hf_model


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several spin against other processes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


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
