"""Which block-scale FP8 GEMM runs for a weight shape and row count: the measured path table.

``fp8_paths.json`` (beside this file) is written by ``evaluation/bench_fp8_gemm.py
--write-paths`` on the GPU: for each weight shape ``"NxK"`` (per rank) and row class (the
measured row counts: M rounds up to the next one, past the last it is the last), the fastest
path including its activation quantization, and the tile config it was measured with:

    {"device": "NVIDIA H200", "m_classes": [1, 16, 64, 256, 2048, 8192],
     "shapes": {"6144x4096": {"16": {"path": "gemv", "config": [32, 4, 4]}, ...}}}

Paths: "cublaslt" (``fp8_scaled_mm.py``), "triton" (``fp8_gemm.py``, ``config`` its tile dict),
"gemv" (``fp8_gemv.py``, ``config`` ``[BLOCK_N, num_warps, num_stages]``). A shape or class not
in the table gets None here and the caller's default (``layers/quantization/fp8_linear.py``).
The table is read once per process; nothing here imports torch.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

TABLE_PATH = Path(__file__).with_name("fp8_paths.json")
BLOCK_PATHS = ("cublaslt", "triton", "gemv")
DEFAULT_M_CLASSES = (1, 16, 64, 256, 2048, 8192)


@dataclass(frozen=True)
class PathChoice:
    """One table entry: the path and the config it was measured with (None: the default)."""

    path: str
    config: tuple | dict | None = None


def m_class(m: int, classes=DEFAULT_M_CLASSES) -> int:
    """The measured row count that ``m`` rows are looked up under."""
    return next((c for c in classes if m <= c), classes[-1])


def parse_table(raw: dict) -> tuple[tuple[int, ...], dict[tuple[int, int, int], PathChoice]]:
    """``(m_classes, {(n, k, m_class): PathChoice})`` of a table dict.

    Raises:
        ValueError: a path that is not one of BLOCK_PATHS, or a malformed shape key.
    """
    classes = tuple(sorted(int(c) for c in raw.get("m_classes") or DEFAULT_M_CLASSES))
    table = {}
    for key, per_m in (raw.get("shapes") or {}).items():
        try:
            n, k = (int(v) for v in key.split("x"))
        except ValueError:
            raise ValueError(f"fp8 path table: shape key {key!r} must be 'NxK'") from None
        for m, entry in per_m.items():
            path = entry["path"]
            if path not in BLOCK_PATHS:
                raise ValueError(
                    f"fp8 path table: {key} M={m} path={path!r} is not allowed: must be one "
                    f"of {list(BLOCK_PATHS)}"
                )
            config = entry.get("config")
            config = tuple(config) if isinstance(config, list) else config
            table[(n, k, int(m))] = PathChoice(path, config)
    return classes, table


@functools.cache
def _table(path: str) -> tuple[tuple[int, ...], dict]:
    p = Path(path)
    if not p.exists():
        return DEFAULT_M_CLASSES, {}
    return parse_table(json.loads(p.read_text()))


def lookup(n: int, k: int, m: int, path: str | Path = TABLE_PATH) -> PathChoice | None:
    """The measured choice for a ``[N, K]`` weight at ``m`` rows, or None."""
    classes, table = _table(str(path))
    return table.get((n, k, m_class(m, classes)))
