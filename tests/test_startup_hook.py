"""``HF_PAGED_BACKEND=paged`` acts in a program that never imports hf_paged: the package installs
``hf_paged_backend.pth``, whose start-up line imports ``_hf_paged_startup`` (and so hf_paged)
only when the variable is set.

The package is installed as pip installs it (the editable wheel setuptools builds, unpacked
into a fresh virtual environment whose other packages are this one's), then the same program
runs with the variable set, with it unset, and with hf_paged broken."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
import zipfile
from pathlib import Path

import pytest

from hf_paged.testing import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
PACKAGING = ["pyproject.toml", "setup.py", "hf_paged_backend.pth", "_hf_paged_startup.py",
             "README.md"]  # fmt: skip
# a program that never imports hf_paged: stock generate, then what ran it
PROGRAM = """\
import json, sys
import torch
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
ids = torch.tensor([[5, 6, 7, 8]])
out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
owners = [v for v in model.__dict__.values() if type(v).__name__ == "EngineOwner"]
print(json.dumps({
    "startup_hook": "_hf_paged_startup" in sys.modules,
    "hf_paged": "hf_paged" in sys.modules,
    "paged": any(o.engine is not None for o in owners),
    "tokens": out[0].tolist(),
}))
"""


def _build_editable_wheel(src: Path, out: Path) -> Path:
    """setuptools' PEP 660 wheel, built from a copy of the packaging files (the build writes
    its metadata beside them)."""
    for name in PACKAGING:
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "hf_paged", src / "hf_paged",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    code = "from setuptools import build_meta as b; print(b.build_editable(sys.argv[1]))"
    done = subprocess.run([sys.executable, "-c", f"import sys; {code}", str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return out / done.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def env_python(tmp_path_factory) -> Path:
    """A fresh virtual environment with hf_paged installed from its editable wheel; torch and
    transformers come from this environment's site-packages (a path line, whose own .pth files
    do not run)."""
    pytest.importorskip("setuptools.command.editable_wheel", reason="needs setuptools >= 64")
    base = tmp_path_factory.mktemp("hook")
    (base / "src").mkdir()
    wheel = _build_editable_wheel(base / "src", base)
    venv.create(base / "venv", with_pip=False)
    python = base / "venv" / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    with zipfile.ZipFile(wheel) as whl:
        top = [n for n in whl.namelist() if "/" not in n]
        assert "hf_paged_backend.pth" in top, top
        whl.extractall(site, members=top)
    Path(site, "zz_outer_site.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return python


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_checkpoint(str(tmp_path_factory.mktemp("hook") / "llama"))


# the same questions without a model, for what needs no generate call
LIGHT = """\
import json, sys
print(json.dumps({"startup_hook": "_hf_paged_startup" in sys.modules,
                  "hf_paged": "hf_paged" in sys.modules, "paged": False}))
"""


def _run(python: Path, ckpt: str, tmp_path: Path, program: str = PROGRAM, **env) -> dict:
    path = tmp_path / "program.py"
    path.write_text(program)
    full_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_PAGED_BACKEND")}
    full_env.update({"OMP_NUM_THREADS": "1", **env})
    done = subprocess.run([str(python), str(path), ckpt], cwd=tmp_path, env=full_env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "stderr": done.stderr}


def test_the_switch_acts_in_a_program_that_never_imports_hf_paged(env_python, ckpt, tmp_path):
    paged = _run(env_python, ckpt, tmp_path, HF_PAGED_BACKEND="paged")
    stock = _run(env_python, ckpt, tmp_path)
    assert paged["startup_hook"] and paged["hf_paged"] and paged["paged"], paged
    assert not stock["startup_hook"] and not stock["hf_paged"] and not stock["paged"], stock
    assert paged["tokens"] == stock["tokens"]


def test_a_broken_hf_paged_does_not_stop_python(env_python, ckpt, tmp_path):
    """The start-up module says why in one warning; the program runs on."""
    broken = tmp_path / "shadow"
    (broken / "hf_paged").mkdir(parents=True)
    (broken / "hf_paged" / "__init__.py").write_text("raise ImportError('broken on purpose')\n")
    out = _run(env_python, ckpt, tmp_path, LIGHT, HF_PAGED_BACKEND="paged",
               PYTHONPATH=str(broken))  # fmt: skip
    assert out["startup_hook"] and not out["hf_paged"]
    assert "HF_PAGED_BACKEND is set but hf_paged could not be imported" in out["stderr"]
    assert "broken on purpose" in out["stderr"]
