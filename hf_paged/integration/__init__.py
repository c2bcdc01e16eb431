"""Hugging Face integration: the ``generate`` dispatcher and the paged ``generate``.

``import hf_paged`` installs the dispatcher (it does nothing until asked); see ``dispatch``.
"""

from hf_paged.integration.dispatch import (
    PagedFallbackWarning,
    configure,
    get_default_backend,
    get_engine,
    install,
    is_installed,
    release,
    set_default_backend,
    uninstall,
)

__all__ = [
    "PagedFallbackWarning",
    "configure",
    "get_default_backend",
    "get_engine",
    "install",
    "is_installed",
    "release",
    "set_default_backend",
    "uninstall",
]
