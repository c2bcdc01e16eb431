"""``import hf_paged``'s one side effect: the dispatchers go on when transformers loads.

``generate``'s dispatcher (``dispatch.install``) patches ``GenerationMixin.generate`` and the
pipeline wrapper (``pipeline.install_pipeline``) patches ``transformers.pipeline``. Both are
inert until asked (``backend="paged"``, ``set_default_backend("paged")``,
``HF_PAGED_BACKEND=paged``). Installing them needs transformers, which takes seconds to import,
so ``install_on_import`` installs each now if its transformers module is loaded already, and
otherwise right after that module first executes (an import hook). ``import hf_paged`` stays
light: nothing here imports torch or transformers.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import threading

# transformers module -> (hf_paged module, its install function)
_TARGETS = {
    "transformers.generation.utils": ("hf_paged.integration.dispatch", "install"),
    "transformers.pipelines": ("hf_paged.integration.pipeline", "install_pipeline"),
}
_lock = threading.RLock()
_pending: set[str] = set()  # targets whose module was not loaded when asked
_deferred: dict[str, str] = {}  # hf_paged module still executing -> its install function


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


class _InstallOnImport(importlib.abc.MetaPathFinder):
    """Runs a target's install right after its transformers module executes."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _pending:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        _pending.discard(fullname)
        if not _pending:
            sys.meta_path.remove(self)
        exec_module = spec.loader.exec_module

        def exec_and_install(module):
            exec_module(module)
            _install(fullname)

        spec.loader.exec_module = exec_and_install
        return spec


_finder = _InstallOnImport()


def install_on_import() -> None:
    """Install both dispatchers now where transformers has loaded the module they patch, else
    when it does. Idempotent."""
    with _lock:
        loaded = [t for t in _TARGETS if t in sys.modules]
        _pending.update(t for t in _TARGETS if t not in sys.modules)
        if _pending and _finder not in sys.meta_path:
            # first: installing a loaded target may import another one
            sys.meta_path.insert(0, _finder)
        for target in loaded:
            _install(target)


def cancel() -> None:
    """Stop installing on import (``hf_paged.uninstall``)."""
    with _lock:
        _pending.clear()
        if _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
