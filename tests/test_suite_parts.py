"""``tests/gpu_parts.py``: every GPU test file is in exactly one part, a folder that is not in
the checkout is skipped with a message, a new top-level folder falls into the last part, and a
bad part number is refused by name."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests import gpu_parts

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = re.compile(r"pytest\.mark\.gpu\b")


def _gpu_test_files() -> list[str]:
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(gpu_parts.NOT_GPU) or path.name == "test_suite_parts.py":
            continue
        if GPU_MARK.search(path.read_text()):
            files.append(rel)
    return files


def _parts_running(rel: str) -> list[int]:
    """The parts whose pytest arguments collect the file ``rel``."""
    found = []
    for p in gpu_parts.PARTS:
        r = gpu_parts.resolve(p)
        inside = any(rel == x or rel.startswith(x.rstrip("/") + "/") for x in r.paths)
        ignored = any(rel == x or rel.startswith(x.rstrip("/") + "/") for x in r.ignore)
        if inside and not ignored:
            found.append(p.number)
    return found


def test_every_gpu_test_file_is_in_exactly_one_part():
    files = _gpu_test_files()
    assert len(files) >= 15  # the grep found the GPU files (kernels, engine, models, hf, ...)
    wrong = {f: _parts_running(f) for f in files if len(_parts_running(f)) != 1}
    assert wrong == {}, f"GPU test files in no part or in several: {wrong}"


def test_a_missing_folder_is_skipped_and_a_new_one_goes_to_the_last_part(tmp_path):
    (tmp_path / "tests" / "engine").mkdir(parents=True)
    (tmp_path / "tests" / "brand_new").mkdir()
    (tmp_path / "tests" / "clients").mkdir()
    first = gpu_parts.resolve(gpu_parts.part(1), tmp_path)
    assert first.paths == ["tests/engine"]
    assert "tests/layers" in first.skipped
    last = gpu_parts.PARTS[-1]
    assert last.rest
    assert gpu_parts.resolve(last, tmp_path).paths == ["tests/brand_new"]


def test_parts_are_numbered_one_to_n_and_a_bad_number_is_refused():
    assert [p.number for p in gpu_parts.PARTS] == list(range(1, len(gpu_parts.PARTS) + 1))
    with pytest.raises(ValueError, match=r"PART=9 is not allowed: must be one of \[1, "):
        gpu_parts.part(9)


def test_the_command_line_lists_and_refuses():
    cmd = [sys.executable, str(ROOT / "tests" / "gpu_parts.py")]
    listed = subprocess.run([*cmd, "list"], capture_output=True, text=True, check=True).stdout
    rows = [line for line in listed.splitlines() if line.startswith("| ")]
    assert len(rows) == len(gpu_parts.PARTS) + 1  # the header and a row per part
    paths = subprocess.run([*cmd, "paths", "4"], capture_output=True, text=True, check=True)
    assert paths.stdout.startswith(
        "-m gpu tests/kernels --ignore=tests/kernels/test_paged_attention.py"
    )
    bad = subprocess.run([*cmd, "run", "0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "PART=0 is not allowed" in bad.stderr
