"""Hypothesis fuzz of SamplingParams / EngineConfig values at and past their limits.

Seeded and derandomized (the same examples every run), bounded example counts. A value is either
accepted, or refused with TypeError / ValueError whose message names the key; an accepted
SamplingParams then runs on a tiny engine without any other exception.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from hf_paged import LLM, EngineConfig, SamplingParams
from hf_paged.testing import save_tiny_model

EXAMPLES = 120
RUN_EXAMPLES = 40
SETTINGS = settings(
    max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)  # fmt: skip

# at and past every limit, plus the wrong types a caller might pass
NUMBERS = st.sampled_from(
    [-(2**63), -3, -2, -1, 0, 1, 2, 3, 64, 2**31, -2.5, -1e-9, 0.0, 1e-9, 0.5, 0.999, 1.0,
     1.0001, 2.0, 2.0001, 1e9, math.inf, -math.inf, math.nan]
)  # fmt: skip
ODD = st.sampled_from([None, True, False, "1", "", b"x", [], [1], (3,), {}, object()])
VALUES = st.one_of(NUMBERS, ODD)


def _sampling_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(SamplingParams)]


def _engine_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(EngineConfig)]


def _build(cls, kwargs):
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        message = str(exc)
        assert any(key in message for key in kwargs), (kwargs, message)
        return None


@seed(1401)
@SETTINGS
@given(st.dictionaries(st.sampled_from(_sampling_keys()), VALUES, max_size=4))
def test_sampling_params_accept_or_name_the_key(kwargs):
    params = _build(SamplingParams, kwargs)
    if params is not None:
        for key, value in kwargs.items():
            got = getattr(params, key)
            assert got == value or (isinstance(value, list) and got == tuple(value))


@seed(1402)
@SETTINGS
@given(st.dictionaries(st.sampled_from(_engine_keys()), VALUES, max_size=4))
def test_engine_config_accept_or_name_the_key(kwargs):
    _build(EngineConfig, kwargs)


@seed(1403)
@settings(SETTINGS, max_examples=40)
@given(st.dictionaries(st.text(min_size=1, max_size=12), st.integers(), min_size=1, max_size=2))
def test_unknown_keys_are_type_errors_naming_them(kwargs):
    unknown = [k for k in kwargs if k not in _engine_keys()]
    if not unknown:
        return
    with pytest.raises(TypeError) as err:
        EngineConfig.from_dict(kwargs)
    assert repr(sorted(unknown)[0]) in str(err.value)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_tiny_model("llama", str(tmp_path_factory.mktemp("fuzz") / "llama"), seed=7)
    with LLM(path, max_model_len=48, kv_block_size=4, num_kv_blocks=64) as engine:
        yield engine


SAMPLING_VALUES = {  # in-range values and the edges, so that most examples run
    "n": st.integers(1, 3),
    "temperature": st.sampled_from([0.0, 1e-6, 0.5, 1.0, 7.0]),
    "top_k": st.sampled_from([-1, 0, 1, 2, 255, 256, 10_000]),
    "top_p": st.sampled_from([1e-6, 0.5, 1.0]),
    "min_p": st.sampled_from([0.0, 0.5, 1.0]),
    "repetition_penalty": st.sampled_from([1e-3, 1.0, 5.0]),
    "presence_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "frequency_penalty": st.sampled_from([-2.0, 0.0, 2.0]),
    "max_tokens": st.integers(1, 6),
    "min_tokens": st.integers(0, 6),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3),
    "ignore_eos": st.booleans(),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),
    "logprobs": st.one_of(st.none(), st.integers(0, 300)),
}


@seed(1404)
@settings(SETTINGS, max_examples=RUN_EXAMPLES)
@given(
    st.fixed_dictionaries({}, optional=SAMPLING_VALUES),
    st.lists(st.lists(st.integers(0, 255), min_size=1, max_size=40), min_size=1, max_size=3),
)
def test_accepted_sampling_params_run(llm, kwargs, prompts):
    params = _build(SamplingParams, kwargs)
    if params is None:
        return
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    except (TypeError, ValueError) as exc:  # e.g. a prompt + max_tokens past max_model_len
        assert "max_model_len" in str(exc) or any(k in str(exc) for k in kwargs), str(exc)
        return
    assert len(outs) == len(prompts)
    for out in outs:
        assert len(out.outputs) == params.n
        for completion in out.outputs:
            assert len(completion.token_ids) <= params.max_tokens
            if params.ignore_eos and not params.stop_token_ids:
                assert len(completion.token_ids) == params.max_tokens
