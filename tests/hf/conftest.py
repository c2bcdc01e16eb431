"""Fixtures for the HF-integration tests: one torch thread, and a clean dispatcher per test (it
is installed, no backend switch is set, fallback warnings start afresh)."""

from __future__ import annotations

import pytest
import torch

from hf_paged import envs
from hf_paged.integration import dispatch


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def clean_dispatch(monkeypatch):
    dispatch.install()
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    envs.reset()
    dispatch.set_default_backend(None)
    dispatch._reset_fallback_warnings()
    yield
    dispatch.set_default_backend(None)
    envs.reset()
