"""The record every benchmark result carries, and where it is written: the environment (git
sha, device, library versions, every ``HF_PAGED_*`` switch), progress lines, the Triton compiles
of a run, a markdown table. The results folder is the caller's (``evaluation/`` passes its
``results/``); nothing here knows where the checkout lies.
"""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_paged import envs

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """A progress line with UTC wall clock and seconds since start."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _git(*args: str) -> str | None:
    try:
        return subprocess.check_output(
            ["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write_record(record: dict, results_dir: str | Path, name: str) -> Path:
    """Write ``record`` as ``results_dir/{name}_{UTC stamp}.json`` (the folder made if missing;
    a value JSON lacks, a dtype or a path, as its ``str``) and return the path."""
    path = Path(results_dir) / f"{name}_{utc_stamp()}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path


def environment() -> dict:
    """git sha (and whether the tree had changes), device, library versions."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        # the device copy of the tree may carry a stale .git: pass HF_PAGED_GIT_SHA=<sha> there
        "git_sha": envs.HF_PAGED_GIT_SHA or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv,
        "date_utc": utc_stamp(),
        **envs.recorded(),
        # every HF_PAGED_* switch's value in this run, defaults included (hf_paged/envs.py)
        "hf_paged_envs": envs.snapshot(),
    }


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    cell = lambda c: str(c).replace("|", "\\|")  # noqa: E731 - "paged|sdpa" inside a cell
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class TritonCompileLog:
    """Counts the Triton kernels compiled (or loaded from the disk cache) inside a ``with``.

    A compile in the middle of a timed run stalls the host for milliseconds to seconds, so the
    benchmarks report them next to the profile. Uses ``triton.knobs.runtime``'s cache and
    post-compile hooks where this Triton has them (a no-op otherwise); earlier hooks still run.
    """

    def __init__(self):
        self.events: list[tuple[str, float]] = []  # (kernel signature, seconds)
        self._t0: float | None = None

    def __enter__(self):
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs
            self._rt = None
            return self
        self._rt = knobs.runtime
        self._prev = (self._rt.jit_cache_hook, self._rt.jit_post_compile_hook)
        prev_cache, prev_post = self._prev

        def on_cache(*args, **kwargs):
            self._t0 = time.perf_counter()
            return prev_cache(*args, **kwargs) if prev_cache else None

        def on_post(*args, **kwargs):
            dt = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
            self.events.append((str(kwargs.get("repr", "?")), dt))
            return prev_post(*args, **kwargs) if prev_post else None

        self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = on_cache, on_post
        return self

    def __exit__(self, *exc):
        if self._rt is not None:
            self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = self._prev
        return False

    def summary(self) -> dict:
        return {
            "count": len(self.events),
            "total_s": sum(dt for _, dt in self.events),
            "kernels": [f"{dt * 1e3:.0f} ms {sig[:300]}" for sig, dt in self.events[:20]],
        }
