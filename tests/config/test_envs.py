"""hf_paged/envs.py: defaults, parsing, read-once caching, bad values, snapshot and apply."""

from __future__ import annotations

import json
import os
import warnings

import pytest

from hf_paged import envs

EXPECTED_DEFAULTS = {
    "HF_PAGED_BACKEND": "hf",
    "HF_PAGED_FUSED": True,
    "HF_PAGED_SKINNY_GEMM": True,
    "HF_PAGED_ARGMAX": True,
    "HF_PAGED_TOKEN_SCORES": True,
    "HF_PAGED_PDL": True,
    "HF_PAGED_PDL_PREFETCH": True,
    "HF_PAGED_PROFILE": False,
    "HF_PAGED_TIMINGS": "",
    "HF_PAGED_GIT_SHA": "",
}
BOOL_SWITCHES = [n for n, v in EXPECTED_DEFAULTS.items() if isinstance(v, bool)]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """No HF_PAGED_* variable set, nothing cached; the cache is dropped again afterwards."""
    for name in list(os.environ):
        if name.startswith("HF_PAGED_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(envs, "_warned_unknown", set())
    envs.reset()
    yield
    envs.reset()


def test_defaults():
    assert envs.snapshot() == EXPECTED_DEFAULTS
    assert set(envs.SWITCHES) == set(EXPECTED_DEFAULTS)
    for name, switch in envs.SWITCHES.items():
        assert switch.doc and switch.name == name
        assert getattr(envs, name) == EXPECTED_DEFAULTS[name] == envs.get(name)


@pytest.mark.parametrize("name", BOOL_SWITCHES)
@pytest.mark.parametrize(
    "raw, value",
    [("0", False), ("1", True), ("false", False), (" OFF ", False), ("Yes", True), ("on", True)],
)
def test_bool_parsing(monkeypatch, name, raw, value):
    monkeypatch.setenv(name, raw)
    assert envs.get(name) is value


@pytest.mark.parametrize("name", BOOL_SWITCHES)
def test_empty_is_the_default(monkeypatch, name):
    monkeypatch.setenv(name, "  ")
    assert envs.get(name) is EXPECTED_DEFAULTS[name]


def test_string_switches(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", " paged ")
    monkeypatch.setenv("HF_PAGED_GIT_SHA", "abc1234")
    assert envs.HF_PAGED_BACKEND == "paged"
    assert envs.HF_PAGED_GIT_SHA == "abc1234"


def test_read_once_until_reset(monkeypatch):
    monkeypatch.setenv("HF_PAGED_PDL", "0")
    assert envs.HF_PAGED_PDL is False
    monkeypatch.setenv("HF_PAGED_PDL", "1")
    assert envs.HF_PAGED_PDL is False  # cached: the environment is read once
    envs.reset("HF_PAGED_PDL")
    assert envs.HF_PAGED_PDL is True


@pytest.mark.parametrize("name", BOOL_SWITCHES)
def test_bad_bool_names_variable_and_allowed_values(monkeypatch, name):
    monkeypatch.setenv(name, "2")
    with pytest.raises(ValueError, match=rf"{name}='2' is not allowed: {name} must be 0 or 1"):
        envs.get(name)
    with pytest.raises(ValueError, match=name):
        envs.snapshot()


def test_bad_choice(monkeypatch):
    monkeypatch.setenv("HF_PAGED_BACKEND", "pagd")
    with pytest.raises(ValueError, match=r"HF_PAGED_BACKEND='pagd'.*one of \['hf', 'paged'\]"):
        envs.HF_PAGED_BACKEND  # noqa: B018


def test_unknown_names():
    with pytest.raises(KeyError, match="HF_PAGED_PDLL"):
        envs.get("HF_PAGED_PDLL")
    with pytest.raises(AttributeError, match="HF_PAGED_PDLL"):
        envs.HF_PAGED_PDLL  # noqa: B018


def test_snapshot_reflects_environment_and_is_json(monkeypatch):
    monkeypatch.setenv("HF_PAGED_FUSED", "0")
    monkeypatch.setenv("HF_PAGED_PROFILE", "1")
    snap = envs.snapshot()
    assert snap == {**EXPECTED_DEFAULTS, "HF_PAGED_FUSED": False, "HF_PAGED_PROFILE": True}
    assert json.loads(json.dumps(snap)) == snap


def test_apply_installs_values_whatever_the_environment(monkeypatch):
    monkeypatch.setenv("HF_PAGED_PDL", "not-a-bool")  # never parsed: apply sets the value
    envs.apply({"HF_PAGED_PDL": False, "HF_PAGED_BACKEND": "paged"})
    assert envs.HF_PAGED_PDL is False and envs.get("HF_PAGED_BACKEND") == "paged"
    with pytest.raises(ValueError, match="HF_PAGED_NOPE"):
        envs.apply({"HF_PAGED_NOPE": True})
    with pytest.raises(ValueError, match=r"HF_PAGED_FUSED='0'.*bool"):
        envs.apply({"HF_PAGED_FUSED": "0"})
    with pytest.raises(ValueError, match="HF_PAGED_BACKEND='gpu'"):
        envs.apply({"HF_PAGED_BACKEND": "gpu"})


def test_unknown_variable_warns_once_with_nearest(monkeypatch):
    monkeypatch.setenv("HF_PAGED_PDL_PREFECH", "0")
    with pytest.warns(
        UserWarning, match="HF_PAGED_PDL_PREFECH.*did you mean HF_PAGED_PDL_PREFETCH"
    ):
        envs.snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        envs.snapshot()  # once per name
