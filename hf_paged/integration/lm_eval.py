"""lm-eval's HFLM on the paged engine: every request of a call in one engine run.

``install_lm_eval()`` (``hf-paged run`` calls it) replaces three methods of
``lm_eval.models.huggingface.HFLM`` once that module is imported, and registers the model name
``hf-paged`` (an HFLM subclass that is always paged); ``uninstall_lm_eval()`` puts the original
function objects back. A patched method runs paged when the process is switched to the paged
backend (``hf-paged run``, ``HF_PAGED_BACKEND=paged``, ``set_default_backend("paged")``) or the
model is ``hf-paged``; otherwise it is stock's. What it serves:

* ``generate_until``: stock's order, grouping, tokenization (``tok_batch_encode`` on stock's
  batches, so BOS and left-truncation to ``max_length - max_gen_toks`` are stock's), then every
  row in one engine run with its own stop strings (``until`` plus the EOS text) and
  ``max_gen_toks``; the text is trimmed as stock trims it. Sampling parameters come from HF's own
  preparation of the same ``generate`` call (``prepare_call``), so the model's generation config
  counts as in stock.
* ``_loglikelihood_tokens`` (``loglikelihood`` tokenizes as stock, then calls it) and
  ``loglikelihood_rolling`` (stock's windows): prompt logprobs of the continuation tokens, all
  requests in one run, contexts shared through the prefix cache (``lm_eval_requests``).

Anything else runs stock, with a ``PagedFallbackWarning`` naming the reason: seq2seq models,
several lm-eval ranks, autocast (``mixed_precision_dtype``), a model the engine does not serve,
``max_length`` in gen_kwargs, logits processors the engine lacks.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.util
import sys
import threading
import warnings

from tqdm.auto import tqdm

from hf_paged.engine.request import EngineRequest
from hf_paged.integration import dispatch
from hf_paged.integration.dispatch import PagedFallbackWarning
from hf_paged.integration.lm_eval_requests import (
    loglikelihood_result,
    score_params,
    score_window,
)

HFLM_MODULE = "lm_eval.models.huggingface"
MODEL_NAME = "hf-paged"
_PATCHED = ("generate_until", "_loglikelihood_tokens", "loglikelihood_rolling")
_originals: dict[str, object] = {}
_warned: set[str] = set()
_lock = threading.Lock()


class NotServed(Exception):
    """This HFLM call runs stock; ``reason`` is a short key, ``detail`` says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


def _warn(method: str, fb: NotServed) -> None:
    with _lock:
        if fb.reason in _warned:
            return
        _warned.add(fb.reason)
    warnings.warn(
        f"lm-eval HFLM.{method} ran stock, not on the paged engine: {fb.detail} [{fb.reason}]",
        PagedFallbackWarning,
        stacklevel=3,
    )


# ---- install ---------------------------------------------------------------------------------


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches HFLM right after ``lm_eval.models.huggingface`` executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname != HFLM_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _patch(module.HFLM)

        spec.loader.exec_module = exec_and_patch
        return spec


_finder = _PatchOnImport()


def install_lm_eval() -> bool:
    """Patch HFLM (now, or when lm-eval imports it) and register ``--model hf-paged``.
    Returns False, changing nothing, when lm_eval is not installed. Idempotent."""
    if importlib.util.find_spec("lm_eval") is None:
        return False
    import lm_eval.models  # noqa: F401  (lm-eval's own names first: it fills an empty registry)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=f"{__name__}:HFPagedLM")
    module = sys.modules.get(HFLM_MODULE)
    if module is not None:
        _patch(module.HFLM)
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
    return True


def uninstall_lm_eval() -> None:
    """Restore HFLM's original methods and stop patching on import."""
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    module = sys.modules.get(HFLM_MODULE)
    with _lock:
        if module is not None:
            for name, fn in _originals.items():
                setattr(module.HFLM, name, fn)
        _originals.clear()


def is_lm_eval_installed() -> bool:
    return bool(_originals)


def _patch(hflm_cls) -> None:
    with _lock:
        if _originals:
            return
        for name in _PATCHED:
            _originals[name] = hflm_cls.__dict__[name]
        hflm_cls.generate_until = _generate_until
        hflm_cls._loglikelihood_tokens = _loglikelihood_tokens
        hflm_cls.loglikelihood_rolling = _loglikelihood_rolling


def __getattr__(name):  # HFPagedLM needs lm_eval; built on first access
    if name == "HFPagedLM":
        from hf_paged.integration.lm_eval_model import HFPagedLM

        return HFPagedLM
    raise AttributeError(name)


# ---- serving -----------------------------------------------------------------------------------


def _active(lm) -> bool:
    return getattr(lm, "always_paged", False) or dispatch.get_default_backend() == "paged"


def engine_for(lm, max_model_len: int):
    """The paged engine of ``lm``'s model, with room for ``max_model_len`` tokens (the model's
    engine config, ``hf_paged.configure``, is raised to that when it is lower).

    Raises:
        NotServed: the call or the model is something the engine does not reproduce.
    """
    if lm.backend != "causal":
        raise NotServed("seq2seq", f"the model is {lm.backend}, not a causal decoder")
    if lm.world_size > 1:
        raise NotServed("data_parallel", f"lm-eval runs {lm.world_size} ranks")
    if getattr(lm, "mixed_precision_dtype", None) is not None:
        raise NotServed("autocast", f"mixed_precision_dtype={lm.mixed_precision_dtype}")
    model = lm.model
    reason = dispatch.precheck(model, {}, {})
    if reason is not None:
        raise NotServed(*reason)
    engine = dispatch.get_engine(model)
    if engine.runtime.max_model_len < max_model_len:
        # kept as the model's engine config, so later calls reuse this engine
        config = dataclasses.replace(engine.config, max_model_len=max_model_len)
        dispatch.configure(model, **dataclasses.asdict(config))
        engine = dispatch.get_engine(model)
    return engine


def run_requests(engine, requests: list, desc: str, disable: bool) -> list:
    """One engine run over every ``EngineRequest``; RequestOutputs in input order.

    At most ``4 * max_num_seqs`` requests are in the engine at once: more cannot run in the
    next steps anyway, and the rest are added between steps, while the GPU runs the step in
    flight, instead of all before the first one."""
    outs: list = [None] * len(requests)
    in_flight = 4 * engine.config.max_num_seqs
    with tqdm(total=len(requests), desc=desc, disable=disable) as bar:
        for i, out in engine.stream(requests, max_in_flight=in_flight):
            outs[i] = out
            bar.update(1)
    return outs


def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, override_bs=None):
    """HFLM._loglikelihood_tokens on the engine: [(logprob, is_greedy)] in request order."""
    original = _originals["_loglikelihood_tokens"]
    if not _active(self) or not requests:
        return original(self, requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
    try:
        engine = engine_for(self, self.max_length + 2)  # window of max_length + 1, + 1 sampled
    except NotServed as fb:
        _warn("loglikelihood", fb)
        return original(self, requests, disable_tqdm=disable_tqdm, override_bs=override_bs)
    windows = [score_window(ctx, cont, self.max_length) for _, ctx, cont in requests]
    outs = run_requests(
        engine,
        [EngineRequest(prompt, score_params(start)) for prompt, start in windows],
        "Running loglikelihood requests (paged)",
        disable_tqdm or self.rank != 0,
    )
    results = [loglikelihood_result(out, start) for out, (_, start) in zip(outs, windows)]
    for (request_str, _, _), answer in zip(requests, results, strict=True):
        if request_str is not None:  # rolling windows are cached per document, by the caller
            self.cache_hook.add_partial("loglikelihood", request_str, answer)
    return results


def _loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
    """HFLM.loglikelihood_rolling with stock's windows, all scored in one engine run."""
    original = _originals["loglikelihood_rolling"]
    if not _active(self) or not requests:
        return original(self, requests, disable_tqdm=disable_tqdm)
    if self.world_size > 1:
        _warn("loglikelihood_rolling", NotServed("data_parallel", "lm-eval runs several ranks"))
        return original(self, requests, disable_tqdm=disable_tqdm)
    from lm_eval import utils

    windows, counts = [], []
    for (string,) in (req.args for req in requests):
        doc = [
            (None, *utils.make_disjoint_window(w))
            for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
        ]
        windows.extend(doc)
        counts.append(len(doc))
    scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
    out, pos = [], 0
    for req, n in zip(requests, counts, strict=True):
        total = sum(s[0] for s in scores[pos : pos + n])
        pos += n
        out.append(total)
        self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
    return out


def _generate_until(self, requests, disable_tqdm: bool = False):
    """HFLM.generate_until on the engine: the generated strings in request order."""
    from hf_paged.integration.lm_eval_generate import generate_until

    original = _originals["generate_until"]
    if not _active(self) or not requests:
        return original(self, requests, disable_tqdm=disable_tqdm)
    try:
        return generate_until(self, requests, disable_tqdm)
    except NotServed as fb:
        _warn("generate_until", fb)
        return original(self, requests, disable_tqdm=disable_tqdm)
