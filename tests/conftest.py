"""Fixtures shared by more than one test folder (each folder's own live in its conftest.py).

``one_thread`` and ``clean_dispatch`` are what the HF-integration and CLI folders turn on for
every test of theirs (their conftest.py requests them from an autouse fixture).
``engines_built`` records the engines the ``generate`` dispatcher builds, for a test that counts
them; ``small_llama`` is a tiny llama configured for ``SMALL_ENGINE``.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several spin against other processes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def clean_dispatch(monkeypatch):
    """The ``generate`` dispatcher installed, no default backend, no switch in the environment,
    switches re-read and fallback warnings forgotten, for one test."""
    from hf_paged import envs
    from hf_paged.integration import dispatch
    from hf_paged.integration.fallback import reset_fallback_warnings

    dispatch.install()
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    envs.reset()  # switches are read once per process: each test reads its own environment
    dispatch.set_default_backend(None)
    reset_fallback_warnings()
    yield
    dispatch.set_default_backend(None)
    envs.reset()


@pytest.fixture
def engines_built(monkeypatch) -> list:
    """The engines the ``generate`` dispatcher builds in this test, in order (each one is still
    built by the real factory)."""
    from hf_paged.integration import dispatch

    built = []
    real = dispatch.engine_factory

    def recording(model, config):
        built.append(real(model, config))
        return built[-1]

    monkeypatch.setattr(dispatch, "engine_factory", recording)
    return built


@pytest.fixture
def small_llama():
    """A tiny fp32 llama (seed 0) configured for ``SMALL_ENGINE``; its engine released after
    the test."""
    from hf_paged.integration import dispatch
    from hf_paged.testing import SMALL_ENGINE, build_hf_model

    model = build_hf_model("llama", seed=0)
    dispatch.configure(model, **SMALL_ENGINE)
    yield model
    dispatch.release(model)
