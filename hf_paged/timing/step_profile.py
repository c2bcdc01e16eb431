"""Opt-in host-side timing of engine steps (``HF_PAGED_PROFILE=1``, or ``HF_PAGED_TIMINGS``).

Sections are wall-clock spans on the host. ``wait`` is the time rank 0 blocks on the GPU for
the sampled tokens, so ``wait`` ~ GPU time not hidden behind host work, and the other sections
are host overhead per step. Off by default: then ``section`` costs one attribute check. With
``HF_PAGED_TIMINGS`` every section's time also goes to the process-wide record (``spans.py``) under
``{prefix}.{section}`` (the engine's: ``engine.schedule``, ``engine.step_total``).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

from hf_paged import envs
from hf_paged.timing import spans


class StepProfile:
    def __init__(self, enabled: bool | None = None, prefix: str = "engine"):
        if enabled is None:
            enabled = envs.HF_PAGED_PROFILE or spans.enabled()
        self.enabled = enabled
        self.prefix = prefix
        self.seconds: dict[str, float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    @contextlib.contextmanager
    def section(self, name: str):
        if not self.enabled:
            yield
            return
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            self.seconds[name] += dt
            self.counts[name] += 1
            spans.add(f"{self.prefix}.{name}", dt)

    def summary(self) -> dict[str, dict[str, float]]:
        """{section: {"total_s", "calls", "mean_ms"}}."""
        return {
            k: {"total_s": v, "calls": self.counts[k], "mean_ms": 1e3 * v / self.counts[k]}
            for k, v in self.seconds.items()
        }


def profile_stats(engine_profile: StepProfile, runner_profile: StepProfile | None) -> dict:
    """``{"profile": {section: summary}}`` of an engine's steps and its runner's (``None``: a
    tensor-parallel executor, whose runners live in other processes), for ``LLMEngine.stats``;
    ``{}`` when profiling is off."""
    if not engine_profile.enabled:
        return {}
    prof = engine_profile.summary()
    if runner_profile is not None:
        prof.update(runner_profile.summary())
    return {"profile": prof}
