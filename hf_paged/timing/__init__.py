"""Timing, in one room: where the wall time of a process and of an engine step goes.

* ``spans.py``: the process-wide record (``HF_PAGED_TIMINGS``): named wall-time spans added up
  and written as one JSON line at exit;
* ``client.py``: the client's own phases (lm-eval, pipelines, ``generate``) as spans, the same
  on a stock run and a paged one;
* ``step_profile.py``: per-section host time of engine steps (``HF_PAGED_PROFILE=1``), shown in
  ``LLMEngine.stats`` / ``LLM.stats`` and fed to the process record;
* ``breakdown.py``: two processes' records side by side (stock and paged), as phases and a table.

Everything here is off by default and imports neither torch nor the rest of the package beyond
``envs`` (the engine and the front ends import it, never the other way round), so a span costs
one check when the switches are off.
"""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.timing import client, spans


def install(after_import: Callable[[str, Callable], None]) -> None:
    """With ``HF_PAGED_TIMINGS`` set: the process record (torch and transformers imported now,
    ``from_pretrained`` timed, the line written at exit) and the client's phases, wrapped as
    their modules load through ``after_import(module, callback)`` (the import hook of
    ``integration/hooks.py``, passed in so that this room imports no front end). Nothing when
    the switch is off; once per process."""
    spans.install()
    client.install(after_import)
