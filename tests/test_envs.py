"""hf_paged/envs.py: defaults, parsing, read-once caching, bad values, snapshot and apply."""

from __future__ import annotations

import ast
import json
import os
import warnings
from pathlib import Path

import pytest
import torch

from hf_paged import envs
from hf_paged.kernels import argmax, fused_act, fused_norm, fused_rope, skinny_gemm, token_scores

EXPECTED_DEFAULTS = {
    "HF_PAGED_BACKEND": "hf",
    "HF_PAGED_FUSED": True,
    "HF_PAGED_SKINNY_GEMM": True,
    "HF_PAGED_FP8_GEMM": "auto",
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


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# Each kernel switch of hf_paged/envs.py turns off exactly the kernels its docstring names.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


pytest.importorskip("triton")


def _dispatch() -> dict[str, bool]:
    """Which kernels take inputs each of them supports, under the current switches."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(2, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, device=dev, dtype=dt)
    q = torch.randn(3, 4, 64, device=dev, dtype=dt)
    k = torch.randn(3, 2, 64, device=dev, dtype=dt)
    cos = torch.randn(3, 64, device=dev, dtype=dt)
    return {
        "norm": fused_norm.supports(x, w),
        "act": fused_act.supports(x),
        "rope": fused_rope.supports(q, k, cos, cos.clone()),
        "argmax": argmax.supports(torch.randn(2, 1000, device=dev)),
        "skinny_gemm": skinny_gemm.supports(x, torch.randn(64, 4096, device=dev, dtype=dt)),
        "token_scores": token_scores.supports(
            x, torch.zeros(2, dtype=torch.int64, device=dev), torch.empty(2, 2, device=dev)
        ),
    }


ALL_ON = {
    "norm": True, "act": True, "rope": True, "argmax": True, "skinny_gemm": True,
    "token_scores": True,
}  # fmt: skip


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "switch, off",
    [
        ("HF_PAGED_FUSED", {"norm", "act", "rope"}),
        ("HF_PAGED_ARGMAX", {"argmax"}),
        ("HF_PAGED_SKINNY_GEMM", {"skinny_gemm"}),
        ("HF_PAGED_TOKEN_SCORES", {"token_scores"}),
    ],
)
def test_switch_covers_exactly_its_kernels(monkeypatch, switch, off):
    assert _dispatch() == ALL_ON
    monkeypatch.setattr(envs, switch, False)
    assert _dispatch() == {name: name not in off for name in ALL_ON}


def _environment_reads(source: str) -> list[int]:
    """Lines of ``source`` that read the process environment (``os.environ`` / ``os.getenv`` /
    ``from os import environ``); setting an item (``os.environ[k] = v``) is not a read."""
    tree = ast.parse(source)
    stores = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store)
    }
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            if (
                isinstance(node.value, ast.Name)
                and node.value.id == "os"
                and id(node) not in stores
            ):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            if any(a.name in ("environ", "getenv", "environb") for a in node.names):
                lines.append(node.lineno)
    return lines


def test_only_envs_reads_the_environment():
    """Every environment read of the package goes through ``envs.py``, even one that only
    records a variable (so the switches and what a result records are found in one place)."""
    package = Path(envs.__file__).parent
    files = sorted(package.rglob("*.py"))
    assert len(files) > 50  # the walk found the package
    found = [
        f"{path.relative_to(package.parent)}:{line}"
        for path in files
        if path.name != "envs.py" or path.parent != package
        for line in _environment_reads(path.read_text())
    ]
    assert not found, f"environment reads outside hf_paged/envs.py: {found}"


def test_an_environment_read_is_found():
    """The check itself: reads are seen, an item set is not."""
    assert _environment_reads("import os\nx = os.environ.get('A')\n") == [2]
    assert _environment_reads("import os\nx = os.getenv('A')\n") == [2]
    assert _environment_reads("from os import environ\n") == [1]
    assert _environment_reads("import os\nos.environ['A'] = '1'\n") == []


def test_recorded_variables(monkeypatch):
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")
    assert envs.recorded() == {"pythonunbuffered": "1"}
    monkeypatch.delenv("PYTHONUNBUFFERED")
    assert envs.recorded() == {"pythonunbuffered": None}
