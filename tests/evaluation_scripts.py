"""Load a script of ``evaluation/`` as a module, for the tests that call its functions: the
folder goes on ``sys.path`` (at the end, shadowing nothing) so that the helpers the scripts
share (``results_dir.py``) import as they do when a script runs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

EVALUATION = Path(__file__).resolve().parents[1] / "evaluation"


def load_evaluation_script(name: str):
    """``evaluation/{name}.py`` as a fresh module (its ``__main__`` part not run)."""
    if str(EVALUATION) not in sys.path:
        sys.path.append(str(EVALUATION))
    spec = importlib.util.spec_from_file_location(f"evaluation_{name}", EVALUATION / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
