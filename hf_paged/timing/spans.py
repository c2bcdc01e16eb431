"""Process-wide wall-time spans, for the client suite's time breakdown (``HF_PAGED_TIMINGS``).

Off by default: :func:`span` then costs one check. When ``HF_PAGED_TIMINGS`` names a file, the
time of every span is added up under its name, and at exit the process appends one JSON line
to that file::

    {"pid", "argv", "uptime_s": seconds since the process started,
     "imports_s": process start to torch and transformers imported (with the switch on,
                  ``import hf_paged`` imports them at once, to time them and wrap
                  ``from_pretrained``; otherwise it imports neither),
     "spans": {name: {"total_s", "calls"}}}

Spans recorded: ``hf.from_pretrained`` (transformers' model loading, wrapped while the switch is
on), ``engine_start`` (building an engine's executor: everything its start does) with the
runner's steps ``engine_start.model_load`` / ``.warmup`` (the profile run: Triton compiles of the
prefill kernels) / ``.kv_cache`` / ``.cuda_graphs`` (decode compiles and capture), and every
engine step's ``engine.schedule`` and ``engine.step_total`` (through ``StepProfile``, which the
switch turns on). A span nested in one of the same name counts once. Every process that
imports hf_paged with the switch set writes its own line (tensor-parallel workers too, with
their runner's spans); a process killed without running ``atexit`` (a Ray actor at shutdown)
writes none.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import os
import sys
import threading
import time
from collections import defaultdict

from hf_paged import envs

_lock = threading.Lock()
_seconds: dict[str, float] = defaultdict(float)
_calls: dict[str, int] = defaultdict(int)
_depth: dict[str, int] = defaultdict(int)
_imports_s: float | None = None
_installed = False


def enabled() -> bool:
    return bool(envs.HF_PAGED_TIMINGS)


@contextlib.contextmanager
def span(name: str):
    """Add the wall time of the ``with`` body to ``name`` (when the switch is on)."""
    if not envs.HF_PAGED_TIMINGS:
        yield
        return
    with _lock:
        _depth[name] += 1
        outer = _depth[name] == 1
    t0 = time.perf_counter()
    try:
        yield
    finally:
        dt = time.perf_counter() - t0
        with _lock:
            _depth[name] -= 1
            if outer:
                _seconds[name] += dt
                _calls[name] += 1


def add(name: str, seconds: float) -> None:
    """Add ``seconds`` to ``name`` (when the switch is on)."""
    if envs.HF_PAGED_TIMINGS:
        with _lock:
            _seconds[name] += seconds
            _calls[name] += 1


def snapshot() -> dict:
    """The record this process would write now."""
    with _lock:
        spans = {k: {"total_s": v, "calls": _calls[k]} for k, v in _seconds.items()}
    return {"pid": os.getpid(), "argv": list(sys.argv), "uptime_s": process_uptime(),
            "imports_s": _imports_s, "spans": spans}  # fmt: skip


def process_uptime() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as f:
            now = float(f.read().split()[0])
        return now - int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22: starttime
    except (OSError, ValueError, IndexError):
        return None


def install() -> None:
    """Called by ``timing.install`` (``import hf_paged``, ``hf-paged run``): with the switch on, import torch and
    transformers (noting when that is done), time transformers' ``from_pretrained`` and write
    the record at exit. Once per process; nothing when the switch is off."""
    global _installed, _imports_s
    if _installed or not enabled():
        return
    _installed = True
    import torch  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    _imports_s = process_uptime()
    _time_from_pretrained()
    atexit.register(_write)


def _time_from_pretrained() -> None:
    from transformers import PreTrainedModel

    func = PreTrainedModel.__dict__["from_pretrained"].__func__

    @functools.wraps(func)
    def from_pretrained(cls, *args, **kwargs):
        with span("hf.from_pretrained"):
            return func(cls, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)


def _write() -> None:
    line = json.dumps(snapshot()) + "\n"
    fd = os.open(envs.HF_PAGED_TIMINGS, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, line.encode())  # one write with O_APPEND: ranks' lines do not interleave
    finally:
        os.close(fd)
