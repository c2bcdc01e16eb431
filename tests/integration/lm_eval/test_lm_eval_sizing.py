"""lm-eval at default ``model_args``: the engine is sized from what the run needs, built once.

HFLM's ``max_length`` defaults to the model's ``max_position_embeddings``. The adapter used to ask
the engine for ``max_length + 1`` (generate_until) and ``max_length + 2`` (loglikelihood), so an
engine first built at the model's default was closed and rebuilt at every run's start; on a GPU
the second build found the first one's memory still reserved and failed. Now a run asks for its
longest request, before its first build: one build, and a window never fed past stock's
``max_length`` positions (the last continuation token is scored from the position before it).
"""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")

from hf_paged.integration import dispatch  # noqa: E402
from hf_paged.testing import save_demo_model  # noqa: E402

MAX_POS = 128  # the demo model's max_position_embeddings, so HFLM's default max_length


@pytest.fixture
def hflm(tmp_path, engines_built):
    """A stock HFLM at default model_args on the tiny model, the adapter installed, the
    engines it builds recorded (``engines_built``, tests/conftest.py)."""
    from lm_eval.models.huggingface import HFLM

    from hf_paged.integration.lm_eval import install as adapter

    adapter.install_lm_eval()
    lm = HFLM(pretrained=save_demo_model(str(tmp_path / "m")), device="cpu", dtype="float32",
              batch_size=4)  # fmt: skip
    assert lm.max_length == MAX_POS
    dispatch.set_default_backend("paged")
    yield lm, engines_built
    dispatch.set_default_backend(None)
    dispatch.release(lm.model)
    adapter.uninstall_lm_eval()


def _lengths(built) -> list[int]:
    """The ``max_model_len`` of each engine built."""
    return [engine.runtime.max_model_len for engine in built]


def _requests(rng, n, ctx_len, cont_len):
    out = []
    for _ in range(n):
        ctx = [rng.randrange(4, 99) for _ in range(ctx_len)]
        out.append((None, ctx, [rng.randrange(4, 99) for _ in range(cont_len)]))
    return out


def _positions_fed(model) -> list[int]:
    """Records the largest position each forward of ``model``'s engine feeds."""
    seen: list[int] = []
    runner = dispatch.get_engine(model).executor.runner
    forward = runner.model.forward

    def spy(input_ids, positions, meta):
        seen.append(int(positions.max()))
        return forward(input_ids, positions, meta)

    runner.model.forward = spy
    return seen


def test_loglikelihood_builds_one_engine_and_equals_stock(hflm):
    lm, builds = hflm
    rng = random.Random(0)
    # short requests, and windows that stock truncates to max_length + 1 tokens
    reqs = _requests(rng, 3, 20, 3) + _requests(rng, 2, MAX_POS + 10, 4)
    dispatch.set_default_backend("hf")
    stock = lm._loglikelihood_tokens(reqs)
    dispatch.set_default_backend("paged")
    ours = lm._loglikelihood_tokens(reqs)
    # a truncated window is max_length + 1 tokens; its prompt is one less, plus one new token
    assert _lengths(builds) == [MAX_POS + 1]
    for (a, ga), (b, gb) in zip(stock, ours, strict=True):
        assert math.isclose(a, b, rel_tol=1e-4, abs_tol=1e-4) and ga == gb
    positions = _positions_fed(lm.model)
    lm._loglikelihood_tokens(reqs)  # the same engine again: nothing is rebuilt
    assert _lengths(builds) == [MAX_POS + 1]
    assert max(positions) <= MAX_POS - 1  # never a position the model (or stock) lacks


def test_short_requests_keep_the_models_default_length(hflm):
    lm, builds = hflm
    reqs = _requests(random.Random(1), 4, 12, 2)
    lm._loglikelihood_tokens(reqs)
    lm._loglikelihood_tokens(reqs)
    assert _lengths(builds) == [MAX_POS]  # one build, at the model's own length


def test_generate_until_builds_one_engine(hflm):
    """generate_until's rows are left-truncated to max_length - max_gen_toks: the default
    engine holds them; the loglikelihood run after it reuses the engine when it fits."""
    from lm_eval.api.instance import Instance

    lm, builds = hflm
    reqs = [
        Instance("generate_until", {}, (ctx, {"until": ["\n\n"], "max_gen_toks": 8}), i)
        for i, ctx in enumerate(["a b c", "the cat sat on the " * 12, "x"])
    ]
    dispatch.set_default_backend("hf")
    stock = lm.generate_until(reqs)
    dispatch.set_default_backend("paged")
    assert lm.generate_until(reqs) == stock
    assert _lengths(builds) == [MAX_POS]
    lm._loglikelihood_tokens(_requests(random.Random(2), 2, 10, 2))
    assert _lengths(builds) == [MAX_POS]


def test_engine_start_is_logged_with_its_reason(hflm, caplog):
    import logging

    lm, _ = hflm
    with caplog.at_level(logging.INFO, logger="hf_paged"):
        lm._loglikelihood_tokens(_requests(random.Random(3), 2, MAX_POS + 5, 2))
    text = caplog.text
    assert "starting an engine (first use)" in text and "engine ready" in text
    assert f"max_model_len={MAX_POS + 1}" in text


def test_scoring_runs_take_larger_steps_unless_the_user_set_them(hflm):
    """A loglikelihood run builds its engine with 16,384-token steps (long prompts run in
    fewer, larger steps); options the user set through ``hf_paged.configure`` are kept."""
    from hf_paged.integration.lm_eval.serving import SCORING_BATCHED_TOKENS

    lm, _ = hflm
    reqs = _requests(random.Random(3), 4, 20, 3)
    lm._loglikelihood_tokens(reqs)
    assert dispatch.owner(lm.model).engine.config.max_num_batched_tokens == SCORING_BATCHED_TOKENS
    dispatch.release(lm.model)
    dispatch.configure(lm.model, max_num_batched_tokens=512)
    lm._loglikelihood_tokens(reqs)
    assert dispatch.owner(lm.model).engine.config.max_num_batched_tokens == 512
