"""What the two coverage runs (``coverage_models.py``: text decoders; ``coverage_vlm.py``:
image-text-to-text) share: one architecture's result, how a paged run is recorded (an exception
is a failure, the model's engine is released, the time kept), the counts and the table rows."""

from __future__ import annotations

import contextlib
import math
import sys
import time
import warnings
from dataclasses import dataclass

# status -> (table order, label); "not_text" is the text run's alone
STATUSES = {
    "served": (0, "served"),
    "failure": (1, "**FAILURE**"),
    "fallback": (2, "fallback"),
    "not_text": (3, "not counted: not a decoder-only text model"),
    "no_build": (4, "not counted: does not build tiny"),
}


@dataclass
class ArchResult:
    model_type: str
    class_name: str
    status: str  # a key of STATUSES
    detail: str = ""
    seconds: float = 0.0


def short(e, n: int = 160) -> str:
    """``e`` as one line of at most ``n`` characters."""
    s = " ".join(str(e).split())
    return s if len(s) <= n else s[: n - 3] + "..."


@contextlib.contextmanager
def paged_run(res: ArchResult, model, t0: float):
    """Around an architecture's paged calls: an exception is its failure (a paged call must
    never raise), the model's engine is released, and ``res.seconds`` counts from ``t0``."""
    from hf_paged import release

    try:
        yield
    except Exception as e:  # noqa: BLE001  recorded as the architecture's failure
        res.status, res.detail = "failure", f"{type(e).__name__}: {short(e)}"
    finally:
        release(model)
        res.seconds = time.perf_counter() - t0


def summary(results: list[ArchResult]) -> dict[str, int]:
    """Results per status, ``built`` (served, fallback, failure) and ``served_pct`` of it."""
    counts = dict.fromkeys(STATUSES, 0)
    for r in results:
        counts[r.status] += 1
    built = counts["served"] + counts["fallback"] + counts["failure"]
    counts["built"] = built
    counts["served_pct"] = math.floor(100 * counts["served"] / built) if built else 0
    return counts


def table_rows(results: list[ArchResult]) -> list[str]:
    """The Markdown table of ``results``: served first, then failures, fallbacks, the rest."""
    lines = ["| model_type | class | result | detail |", "|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (STATUSES[r.status][0], r.model_type)):
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| {r.model_type} | {r.class_name} | {STATUSES[r.status][1]} | {detail} |")
    return lines


def run_and_print(run_all, markdown_table, folder) -> list[ArchResult]:
    """The tests' module fixture: every architecture run (warnings quiet), the table printed
    and written to ``folder/coverage.md``."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = run_all()
    table = markdown_table(results)
    print("\n" + table)
    (folder / "coverage.md").write_text(table)
    return results


def print_row(r: ArchResult) -> None:
    """One architecture's progress line on stderr (the command line runs)."""
    print(f"ROW {r.model_type:32s} {r.status:9s} {r.seconds:5.1f}s {r.detail[:160]}",
          file=sys.stderr, flush=True)  # fmt: skip


def print_table(table: str, path: str | None) -> None:
    """The table on stdout, and into ``path`` when given."""
    print(table)
    if path:
        with open(path, "w") as f:
            f.write(table)
