"""The client's own phases as timing spans, the same on a stock run and a paged one.

With ``HF_PAGED_TIMINGS`` set (``hf-paged run --timings FILE``; ``--backend hf`` runs the
program stock under the same hooks), the functions below are wrapped when their module is first
imported, so both processes split their wall time the same way (``breakdown.py`` turns two
records into one table):

* ``client.setup``: lm-eval's task index and request building;
* ``client.tokenize``: the tokenizer calls of lm-eval's HFLM and of the pipeline's preprocess;
* ``client.requests``: one request kind of lm-eval (loglikelihood with its tokenization,
  loglikelihood_rolling, generate_until), a pipeline's ``__call__``, or a ``generate`` call:
  everything from the client's call to its answers;
* ``model.stock``: the model work of a stock run (HFLM's ``_model_call`` / ``_model_generate``,
  and every ``generate`` call the dispatcher sends to stock, so the pipeline's too); a paged
  run's model work is its engine steps (``engine.step_total``);
* ``client.results``: lm-eval's ``process_results`` and the writing of its result files;
  the pipeline's ``postprocess``.

A span nested in one of the same name counts once (``spans.span``), so ``generate`` inside a
pipeline call is not counted twice under ``client.requests``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from hf_paged.timing import spans

# module -> [(class name, method name, span)]
_WRAPPED: dict[str, list[tuple[str, str, str]]] = {
    "lm_eval.tasks.manager": [("TaskManager", "__init__", "client.setup")],
    "lm_eval.api.task": [
        ("Task", "build_all_requests", "client.setup"),
        ("ConfigurableTask", "process_results", "client.results"),
    ],
    "lm_eval.models.huggingface": [
        ("HFLM", "loglikelihood", "client.requests"),
        ("HFLM", "tok_encode", "client.tokenize"),
        ("HFLM", "tok_batch_encode", "client.tokenize"),
        ("HFLM", "_model_call", "model.stock"),
        ("HFLM", "_model_generate", "model.stock"),
    ],
    "lm_eval.loggers.evaluation_tracker": [
        ("EvaluationTracker", "save_results_aggregated", "client.results"),
        ("EvaluationTracker", "save_results_samples", "client.results"),
    ],
    "transformers.pipelines.text_generation": [
        ("TextGenerationPipeline", "__call__", "client.requests"),
        ("TextGenerationPipeline", "preprocess", "client.tokenize"),
        ("TextGenerationPipeline", "postprocess", "client.results"),
    ],
}
_installed = False


def install(after_import: Callable[[str, Callable], None]) -> None:
    """Wrap the client functions above as their modules load, through ``after_import(module,
    callback)`` (once; nothing when the timings switch is off). lm-eval's request methods that
    the paged patch replaces are timed by the patch itself (``integration/lm_eval/install.py``),
    on both backends."""
    global _installed
    if _installed or not spans.enabled():
        return
    _installed = True
    for module in _WRAPPED:
        after_import(module, _wrap_module)


def _wrap_module(module) -> None:
    for cls_name, method, name in _WRAPPED[module.__name__]:
        cls = getattr(module, cls_name, None)
        fn = getattr(cls, "__dict__", {}).get(method)
        if fn is None or getattr(fn, "_hf_paged_span", None):
            continue  # a version without it: that phase stays in the process's rest
        setattr(cls, method, _spanned(fn, name))


def _spanned(fn, name: str):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        with spans.span(name):
            return fn(*args, **kwargs)

    timed._hf_paged_span = name
    return timed
