"""lm-eval's HFLM on the paged engine: every request of a call in one engine run.

``install_lm_eval()`` (``hf-paged run`` calls it) replaces four methods of
``lm_eval.models.huggingface.HFLM`` once that module is imported, and registers the model name
``hf-paged`` (an HFLM subclass that is always paged); ``uninstall_lm_eval()`` puts the original
function objects back. A patched method runs paged when the process is switched to the paged
backend (``hf-paged run``, ``HF_PAGED_BACKEND=paged``, ``set_default_backend("paged")``) or the
model is ``hf-paged``; otherwise it is stock's. What it serves:

* ``generate_until``: stock's order, grouping, tokenization (``tok_batch_encode`` on stock's
  batches, so BOS and left-truncation to ``max_length - max_gen_toks`` are stock's), then every
  row in one engine run with its own stop strings (``until`` plus the EOS text) and
  ``max_gen_toks``; the text is trimmed as stock trims it. Sampling parameters come from HF's own
  preparation of the same ``generate`` call (``route``), so the model's
  generation config counts as in stock (``generate_until.py``).
* ``loglikelihood``: stock's tokenization (``TemplateLM.loglikelihood``), each distinct string
  encoded once by the tokenizer's batch call (``tokenize.py``), then ``_loglikelihood_tokens``;
  stock's own method when the HFLM is not paged, is seq2seq, or a subclass overrides how it
  tokenizes.
* ``_loglikelihood_tokens`` and ``loglikelihood_rolling`` (stock's windows): prompt logprobs of
  the continuation tokens, all requests in one run, contexts shared through the prefix cache
  (``loglikelihood.py``).

Anything else runs stock, with a ``PagedFallbackWarning`` naming the reason: seq2seq models,
several lm-eval ranks, autocast (``mixed_precision_dtype``), a model the engine does not serve,
``max_length`` in gen_kwargs, logits processors the engine lacks.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading

from hf_paged.integration import hooks
from hf_paged.refusal import Refusal
from hf_paged.timing import spans

# The request adapters (and through them torch, transformers and the engine) load at the first
# request, not here: ``hf-paged run`` installs this patch before the program starts, and a
# program that never serves a request must not pay their import.

HFLM_MODULE = "lm_eval.models.huggingface"
MODEL_NAME = "hf-paged"
_PATCHED = ("generate_until", "loglikelihood", "_loglikelihood_tokens", "loglikelihood_rolling")
# name -> the function stock runs (HFLM's own, or the one it inherits)
_originals: dict[str, object] = {}
# names HFLM inherits rather than defines: uninstall deletes them from HFLM again
_inherited: set[str] = set()
_lock = threading.Lock()


def _patch_module(module) -> None:
    _patch(module.HFLM)


def install_lm_eval() -> bool:
    """Patch HFLM (now, or when lm-eval imports it) and register ``--model hf-paged``.
    Returns False, changing nothing, when lm_eval is not installed. Idempotent."""
    if importlib.util.find_spec("lm_eval") is None:
        return False
    import lm_eval.models  # noqa: F401  (lm-eval's own names first: it fills an empty registry)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target="hf_paged.integration.lm_eval.model:HFPagedLM")
    hooks.cancel_after_import(HFLM_MODULE, _patch_module)
    hooks.after_import(HFLM_MODULE, _patch_module)  # now, or when lm-eval imports it
    return True


def uninstall_lm_eval() -> None:
    """Restore HFLM's original methods and stop patching on import."""
    hooks.cancel_after_import(HFLM_MODULE, _patch_module)
    module = sys.modules.get(HFLM_MODULE)
    with _lock:
        if module is not None:
            for name, fn in _originals.items():
                if name in _inherited:
                    delattr(module.HFLM, name)
                else:
                    setattr(module.HFLM, name, fn)
        _originals.clear()
        _inherited.clear()


def is_lm_eval_installed() -> bool:
    return bool(_originals)


def _patch(hflm_cls) -> None:
    with _lock:
        if _originals:
            return
        for name in _PATCHED:
            if name not in hflm_cls.__dict__:
                _inherited.add(name)
            _originals[name] = getattr(hflm_cls, name)
        hflm_cls.generate_until = _generate_until
        hflm_cls.loglikelihood = _loglikelihood
        hflm_cls._loglikelihood_tokens = _loglikelihood_tokens
        hflm_cls.loglikelihood_rolling = _loglikelihood_rolling


# ---- the patched methods: paged when active, stock (with a warning) when not served ----------


def _serve(method: str, adapter: str, original, self, requests, **kwargs):
    """``adapter`` (``"module:function"`` of this package) when this HFLM runs paged, else (or
    on a named fallback: the ``Refusal`` the adapter returns, or the ``PagedFallback`` a
    ``generate`` call's route raises) stock's ``original``."""
    from hf_paged.integration.fallback import PagedFallback, warn_fallback
    from hf_paged.integration.lm_eval.serving import is_active

    # the request phase of the client's time breakdown, stock and paged alike
    with spans.span("client.requests"):
        if not is_active(self) or not requests:
            return _stock(original, self, requests, **kwargs)
        module, _, name = adapter.partition(":")
        paged = getattr(importlib.import_module(f"hf_paged.integration.lm_eval.{module}"), name)
        try:
            result = paged(self, requests, kwargs.get("disable_tqdm", False))
        except PagedFallback as fb:
            result = fb.refusal
        if not isinstance(result, Refusal):
            return result
        warn_fallback(result, f"lm-eval HFLM.{method}")
        return _stock(original, self, requests, **kwargs)


def _stock(original, self, requests, **kwargs):
    """Stock's method, after the model's CUDA engine gave its memory back (stock's own forward
    calls do not pass through the generate dispatcher; see ``engine_owner``). No engine can
    exist before ``engine_owner`` is loaded, so a stock-only run does not import it."""
    owners = sys.modules.get("hf_paged.integration.engine_owner")
    model = getattr(self, "model", None)
    if owners is not None and model is not None:
        owners.give_back_for_stock(model)
    return original(self, requests, **kwargs)


def _loglikelihood(self, requests, disable_tqdm: bool = False):
    """HFLM.loglikelihood: stock's requests for ``_loglikelihood_tokens``, tokenized in batches
    when this HFLM runs paged and tokenizes as lm-eval does; otherwise stock's method."""
    from hf_paged.integration.lm_eval.serving import is_active

    original = _originals["loglikelihood"]
    with spans.span("client.requests"):
        if not requests or not is_active(self):
            return original(self, requests, disable_tqdm=disable_tqdm)
        from hf_paged.integration.lm_eval import loglikelihood as adapter

        if not adapter.tokenizes_as_stock(self):
            return original(self, requests, disable_tqdm=disable_tqdm)
        return adapter.loglikelihood(self, requests, disable_tqdm)


def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
    """HFLM._loglikelihood_tokens on the engine: [(logprob, is_greedy)] in request order."""
    return _serve("loglikelihood", "loglikelihood:loglikelihood_tokens",
                  _originals["_loglikelihood_tokens"], self, requests, disable_tqdm=disable_tqdm,
                  override_bs=override_bs)  # fmt: skip


def _loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    """HFLM.loglikelihood_rolling with stock's windows, all scored in one engine run."""
    return _serve("loglikelihood_rolling", "loglikelihood:loglikelihood_rolling",
                  _originals["loglikelihood_rolling"], self, requests,
                  disable_tqdm=disable_tqdm)  # fmt: skip


def _generate_until(self, requests, disable_tqdm: bool = False):
    """HFLM.generate_until on the engine: the generated strings in request order."""
    return _serve("generate_until", "generate_until:generate_until", _originals["generate_until"],
                  self, requests, disable_tqdm=disable_tqdm)  # fmt: skip
