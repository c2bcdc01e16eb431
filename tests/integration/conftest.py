"""Fixtures for the generate-integration tests: a clean dispatcher per test, and one tiny llama
per engine kind ("fake" = tests/integration/fake_engine.py, "real" = LLMEngine), each keeping its
engine for the whole module like a user's model would."""

from __future__ import annotations

import pytest
import torch

from hf_paged import envs
from hf_paged.integration import dispatch
from hf_paged.integration.fallback import reset_fallback_warnings
from tests.helpers import build_hf_model
from tests.integration.fake_engine import FakeEngine
from tests.integration.parity_utils import SMALL_ENGINE

ENGINE_KINDS = ("fake", "real")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several spin against other processes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def clean_dispatch(monkeypatch):
    dispatch.install()
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    envs.reset()  # switches are read once per process: each test reads its own environment
    dispatch.set_default_backend(None)
    reset_fallback_warnings()
    yield
    dispatch.set_default_backend(None)
    envs.reset()


def fake_factory(model, config):
    return FakeEngine(model, config)


@pytest.fixture(scope="module")
def models():
    """One tiny llama per engine kind (same weights), released at the end of the module."""
    torch.manual_seed(0)
    built = {kind: build_hf_model("llama", seed=0) for kind in ENGINE_KINDS}
    for m in built.values():
        dispatch.configure(m, **SMALL_ENGINE)
    yield built
    for m in built.values():
        dispatch.release(m)


@pytest.fixture(params=ENGINE_KINDS)
def model(request, models, monkeypatch):
    """The tiny llama whose paged calls run on the fake or the real engine."""
    if request.param == "fake":
        monkeypatch.setattr(dispatch, "engine_factory", fake_factory)
    return models[request.param]
