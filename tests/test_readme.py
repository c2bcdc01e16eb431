"""The README a newcomer reads first: at most 250 lines, opening with the two commands that work
on a fresh machine; every snippet on the demo model's path; no issue numbers or commit hashes in
it or in docs/; its links lead somewhere; and, where the demo model is there, every snippet runs.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MODEL = "./models/smollm2-135m-instruct"


def _blocks(text: str) -> list[tuple[str, str]]:
    """``(language, code)`` of every fenced block."""
    return re.findall(r"```(\w*)\n(.*?)```", text, re.S)


def test_at_most_250_lines_opening_with_make_demo_and_make_test():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    lang, first = _blocks(text)[0]
    assert text.index("```") < text.index("\n## ")  # before any section
    commands = [line.split("#")[0].strip() for line in first.splitlines() if line.strip()]
    assert (lang, commands) == ("bash", ["make demo", "make test"])


def test_every_snippet_uses_the_demo_model_path():
    code = "\n".join(c for _, c in _blocks(README.read_text()))
    paths = re.findall(r"""["'=](\.?/?models/[\w.\-/]+|path/to[\w./\-]*)""", code)
    assert paths and set(paths) == {MODEL}, paths
    for call in ("LLM(", "from_pretrained(path)", "model=", "pretrained="):
        assert call in code


_HISTORY = [
    (r"\bissue \d+", "an issue number"),
    (r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b", "a commit hash"),
    (r"\bsession\b", "a development session"),
]


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_no_development_history(page):
    text = page.read_text()
    for pattern, what in _HISTORY:
        found = re.findall(pattern, text, re.I)
        assert not found, f"{page.name} has {what}: {found[:3]}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_links_lead_somewhere(page):
    for target in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
        if target.startswith(("http://", "https://")):
            continue
        path = (page.parent / target).resolve()
        assert path.exists(), f"{page.name} links to {target}, which is not there"


def _runnable() -> list[tuple[str, str]]:
    """The snippets a test can run: not the install commands, nor Ray's without ray."""
    out = []
    for lang, code in _blocks(README.read_text()):
        if lang not in ("python", "bash") or re.search(
            r"^(make|git|pip) |fetch-demo-model", code, re.M
        ):
            continue
        out.append((lang, code))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("lang, code", _runnable(), ids=lambda x: x.splitlines()[0][:40])
def test_snippet_runs(lang, code):
    """Each snippet as a user would paste it, from the repository root, on the demo model."""
    if not (ROOT / MODEL).is_dir():
        pytest.skip(f"{MODEL} is not there: `hf-paged fetch-demo-model` writes it")
    if "hf_paged.ray" in code and importlib.util.find_spec("ray") is None:
        pytest.skip("needs ray[data] (pip install -e '.[ray]')")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1"}  # fmt: skip
    env.pop("HF_PAGED_BACKEND", None)
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:  # the console script as this interpreter runs it
        cli = f"{sys.executable} -m hf_paged.entrypoints.cli "
        cmd = ["bash", "-c", code.replace("hf-paged ", cli)]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip(), "the snippet printed nothing"
