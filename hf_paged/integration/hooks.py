"""``import hf_paged``'s one side effect, ``install_on_import``: the dispatchers go on when
transformers loads (and, only when ``HF_PAGED_TIMINGS`` names a file, the timing hooks).

``generate``'s dispatcher (``dispatch.install``) patches ``GenerationMixin.generate`` and the
pipeline wrapper (``pipeline.install_pipeline``) patches ``transformers.pipeline``. Both are
inert until asked (``backend="paged"``, ``set_default_backend("paged")``,
``HF_PAGED_BACKEND=paged``). Installing them needs transformers, which takes seconds to import,
so ``install_on_import`` installs each now if its transformers module is loaded already, and
otherwise right after that module first executes (``after_import``, an import hook that
lm-eval's HFLM patch uses too). The timing record (``timing.install``) is inert unless
``HF_PAGED_TIMINGS`` names a file; then it imports torch and transformers at once (to time them)
and wraps the client's phases through the same hook. Otherwise nothing here imports torch or
transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading
from collections.abc import Callable

from hf_paged import timing

# transformers module -> (hf_paged module, its install function)
_TARGETS = {
    "transformers.generation.utils": ("hf_paged.integration.dispatch", "install"),
    "transformers.pipelines": ("hf_paged.integration.pipeline", "install_pipeline"),
}
_lock = threading.RLock()
_deferred: dict[str, str] = {}  # hf_paged module still executing -> its install function


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs the callbacks registered for a module right after the module first executes."""

    def __init__(self):
        self.callbacks: dict[str, list[Callable]] = {}

    def find_spec(self, fullname, path, target=None):
        if fullname not in self.callbacks:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        callbacks = self.callbacks.pop(fullname)
        exec_module = spec.loader.exec_module

        def exec_and_call(module):
            exec_module(module)
            for fn in callbacks:
                fn(module)

        spec.loader.exec_module = exec_and_call
        return spec


_finder = _AfterImport()


def after_import(module: str, fn: Callable) -> None:
    """Call ``fn(module object)`` now if ``module`` is loaded, else right after it executes."""
    with _lock:
        loaded = sys.modules.get(module)
        if loaded is None:
            _finder.callbacks.setdefault(module, []).append(fn)
            if _finder not in sys.meta_path:
                sys.meta_path.insert(0, _finder)
            return
    fn(loaded)


def cancel_after_import(module: str, fn: Callable | None = None) -> None:
    """Forget ``fn`` (every callback when None) registered for ``module``."""
    with _lock:
        fns = _finder.callbacks.get(module, [])
        fns[:] = [] if fn is None else [f for f in fns if f is not fn]
        if not fns:
            _finder.callbacks.pop(module, None)


def _install(target: str) -> None:
    module, fn = _TARGETS[target]
    found = sys.modules.get(module)
    spec = getattr(found, "__spec__", None)
    if found is not None and getattr(spec, "_initializing", False):
        # the install's own module imports transformers, which brought the target in: the
        # install runs when that module has finished executing (``module_ready``)
        _deferred[module] = fn
        return
    getattr(importlib.import_module(module), fn)()


def module_ready(module: str) -> None:
    """Called by an installing module as its last statement: runs an install deferred while it
    was still executing."""
    fn = _deferred.pop(module, None)
    if fn is not None:
        getattr(sys.modules[module], fn)()


def install_on_import() -> None:
    """Install both dispatchers now where transformers has loaded the module they patch, else
    when it does; and the timing record and client spans when ``HF_PAGED_TIMINGS`` is set.
    Idempotent (the installs themselves are): ``hf-paged run`` calls it again after setting
    the variables it takes from its options."""
    timing.install(after_import)
    with _lock:
        pending = [t for t in _TARGETS if t not in sys.modules]
        for target in pending:  # first: installing a loaded target may import another one
            cancel_after_import(target, _installer(target))
            after_import(target, _installer(target))
        for target in _TARGETS:
            if target not in pending:
                _install(target)


def cancel() -> None:
    """Stop installing on import (``hf_paged.uninstall``)."""
    for target in _TARGETS:
        cancel_after_import(target, _installer(target))


_installers: dict[str, Callable] = {}


def _installer(target: str) -> Callable:
    """The one callback object per target (so registering twice can be undone)."""
    if target not in _installers:
        _installers[target] = lambda _module, t=target: _install(t)
    return _installers[target]
