"""Every script under ``evaluation/`` loads: its imports resolve against this package (a script
that still imported a module the package had moved failed only on the GPU machine, where it was
about to run). Loading runs no benchmark: each script's work is under ``__main__``. The helper
modules the scripts share (``HELPERS``) load too; they have no ``main``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p for p in (ROOT / "evaluation").glob("*.py"))
HELPERS = {"results_dir.py"}  # imported by the scripts (``from results_dir import RESULTS_DIR``)


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_script_loads(path, monkeypatch):
    monkeypatch.syspath_prepend(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"evaluation_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if path.name in HELPERS:
        assert module.RESULTS_DIR == ROOT / "evaluation" / "results"
    else:
        assert callable(getattr(module, "main", None)), f"{path.name}: no main()"
