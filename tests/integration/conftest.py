"""Fixtures of the HF-integration tests.

Every test here runs with one torch thread and a clean dispatcher (tests/conftest.py). The
generate tests get one tiny llama per engine kind ("fake" = fake_engine.py, "real" =
LLMEngine), each keeping its engine for the whole module like a user's model would; the
pipeline tests get a checkpoint, a stock pipeline and a served-call counter.
"""

from __future__ import annotations

import pytest
import transformers

from hf_paged.entrypoints.cli.run import ServedCounter
from hf_paged.integration import dispatch
from hf_paged.integration.pipeline import (
    install_pipeline,
    is_pipeline_installed,
    uninstall_pipeline,
)
from hf_paged.testing import SMALL_ENGINE, build_hf_model, build_tiny, save_checkpoint
from tests.integration.fake_engine import FakeEngine

ENGINE_KINDS = ("fake", "real")


@pytest.fixture(autouse=True)
def _hf_state(one_thread, clean_dispatch):
    """``one_thread`` and ``clean_dispatch`` (tests/conftest.py) for every test here."""


def fake_factory(model, config):
    return FakeEngine(model, config)


@pytest.fixture(scope="module")
def models():
    """One tiny llama per engine kind (same weights), released at the end of the module."""
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


# ---- the generate-contract tests (test_returned_cache.py, test_inputs_embeds.py) ---------------

# native Llama, a generic-path model with sliding layers, an MoE, a hybrid with recurrent layers
CONTRACT_FAMILIES = ("llama", "gemma2", "qwen3_moe", "qwen3_5_text")


@pytest.fixture(scope="module")
def family_models():
    """One tiny fp32 model per family of ``CONTRACT_FAMILIES``, configured for the small engine
    and released at the end of the module."""
    built = {}
    for fam in CONTRACT_FAMILIES:
        model = build_hf_model("llama", seed=0) if fam == "llama" else build_tiny(fam, seed=0)[1]
        dispatch.configure(model, **SMALL_ENGINE)
        built[fam] = model
    yield built
    for model in built.values():
        dispatch.release(model)


@pytest.fixture(params=CONTRACT_FAMILIES)
def family_model(request, family_models):
    return family_models[request.param]


@pytest.fixture
def refusals(monkeypatch):
    """The reason key of every paged call that ran stock (a served call adds nothing)."""
    seen: list[str] = []
    stock = dispatch.call_stock

    def recording(original, model, args, kwargs, fb=None):
        if fb is not None:
            seen.append(fb.reason)
        return stock(original, model, args, kwargs, fb)

    monkeypatch.setattr(dispatch, "call_stock", recording)
    return seen


# ---- the pipeline tests (test_pipeline*.py) ---------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_wrapper():
    """``transformers.pipeline`` patched for the module, restored after it if it was not (the
    pipeline test modules use it for all their tests)."""
    was = is_pipeline_installed()
    install_pipeline()
    yield
    if not was:
        uninstall_pipeline()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("pipe") / "llama"))


@pytest.fixture(scope="module")
def stock_pipe(ckpt, pipeline_wrapper):
    return transformers.pipeline("text-generation", model=ckpt, device="cpu")


@pytest.fixture
def counter():
    """Counts the engine's calls during one test."""
    c = ServedCounter()
    c.install()
    yield c
    c.uninstall()


@pytest.fixture
def hf_datasets():
    """The ``datasets`` package; the test skips where it is not installed (the GPU image)."""
    return pytest.importorskip("datasets", reason="needs the datasets package (not installed)")
