"""Where the evaluation scripts write their results by default: this checkout's
``evaluation/results`` (a script's ``--out`` / ``--out-dir`` / ``OUT`` names another). The
scripts pass it to ``hf_paged.benchmarks.run_record``, which knows no checkout."""

from __future__ import annotations

from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
