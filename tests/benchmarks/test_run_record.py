"""``benchmarks/run_record.py``: a result is written into the folder its caller names (the
package knows no checkout: nothing under ``hf_paged/benchmarks`` computes a results folder)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from hf_paged.benchmarks.run_record import write_record

PACKAGE = Path(__file__).resolve().parents[2] / "hf_paged" / "benchmarks"


def test_write_record_writes_into_the_given_folder(tmp_path):
    folder = tmp_path / "made" / "here"  # missing: made
    path = write_record({"a": 1, "when": Path("/x")}, folder, "bench_smoke")
    assert path.parent == folder
    assert re.fullmatch(r"bench_smoke_\d{8}T\d{6}Z\.json", path.name), path.name
    assert json.loads(path.read_text()) == {"a": 1, "when": "/x"}  # str() of what JSON lacks


def test_no_results_folder_is_computed_in_the_package():
    for path in PACKAGE.glob("*.py"):
        text = path.read_text()
        assert "parents[" not in text and "RESULTS_DIR" not in text, path.name
