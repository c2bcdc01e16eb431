"""The test tree collects where optional packages are missing (the GPU image has no datasets,
lm-eval or ray): every test module that needs one skips through ``pytest.importorskip`` or
imports it inside the test, so ``pytest -m gpu`` runs the rest.

One pytest subprocess collects the whole tree with those packages hidden: a ``-p`` plugin sets
``sys.modules[name] = None`` for each before any test module is imported, so ``import name``
raises ``ModuleNotFoundError`` and ``importlib.util.find_spec(name)`` says it is not there (what
transformers' availability checks read).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HIDDEN = ("datasets", "lm_eval", "peft", "ray")

PLUGIN = """
import sys

HIDDEN = {hidden!r}
for name in list(sys.modules):
    if name.split(".")[0] in HIDDEN:
        del sys.modules[name]
for name in HIDDEN:
    sys.modules[name] = None  # import raises ModuleNotFoundError; find_spec returns None
"""


def _collect(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "hide_optional_packages.py").write_text(PLUGIN.format(hidden=HIDDEN))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_dir), str(ROOT), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "-p", "hide_optional_packages", *args]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_the_tree_collects_without_the_optional_packages(tmp_path):
    run = _collect(tmp_path, "tests")
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"collection failed with {HIDDEN} hidden:\n{out[-6000:]}"
    assert "ERROR" not in out and "tests/hf/test_pipeline.py" in out, out[-3000:]


def test_the_plugin_really_hides_them(tmp_path):
    """The check above means something: a module that imports datasets at module level fails
    to collect under the plugin."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "test_needs_datasets.py").write_text("import datasets\n\ndef test_x():\n    pass\n")
    run = _collect(tmp_path, str(probe), "--rootdir", str(probe))
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "import of datasets halted" in out, out[-3000:]
