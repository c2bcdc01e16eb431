"""Running stock: the one exception that says a call can't go paged, and its warn-once.

Every "why not" helper returns a ``Refusal`` (``hf_paged.refusal``) where it judges; the
boundaries (``route`` for a ``generate`` call, ``EngineOwner`` for a model's engine) raise it as
``PagedFallback.of(refusal)``, before anything is queued. Where there is a stock implementation
to fall back on (the ``generate`` dispatcher, lm-eval's HFLM methods, pipelines), it is called
and ``warn_fallback`` emits one
``PagedFallbackWarning`` per reason per process; where there is none (``PagedModelForCausalLM``,
``LLM``) the front end turns the same exception into its own error with the same detail.
"""

from __future__ import annotations

import contextvars
import threading
import warnings

from hf_paged.refusal import Refusal


class PagedFallbackWarning(UserWarning):
    """A paged call ran stock transformers (or stock lm-eval) for the reason in the message."""


class PagedFallback(Exception):
    """This call must run stock: a ``Refusal`` raised. ``reason`` is a short key (one warning per
    key per process); ``detail`` says why in words, and how to change the call where there is a
    way."""

    def __init__(self, refusal: Refusal):
        super().__init__(f"{refusal.reason}: {refusal.detail}")
        self.refusal = refusal

    @classmethod
    def of(cls, refusal: Refusal) -> PagedFallback:
        """The exception that raises ``refusal``."""
        return cls(refusal)

    @property
    def reason(self) -> str:
        return self.refusal.reason

    @property
    def detail(self) -> str:
        return self.refusal.detail


_warned: set[str] = set()
_lock = threading.Lock()
# set while stock generate runs for a paged call: generate calls made inside it stay stock
_in_stock = contextvars.ContextVar("hf_paged_in_stock", default=False)


def warn_fallback(fb: Refusal | PagedFallback, what: str = "generate(backend='paged')") -> None:
    """One ``PagedFallbackWarning`` per ``fb.reason`` per process; ``what`` names the call."""
    with _lock:
        if fb.reason in _warned:
            return
        _warned.add(fb.reason)
    warnings.warn(
        f"{what} ran stock, not on the paged engine: {fb.detail} [{fb.reason}]",
        PagedFallbackWarning,
        stacklevel=3,
    )


def reset_fallback_warnings() -> None:
    """Forget which reasons warned (tests)."""
    with _lock:
        _warned.clear()


def call_stock(original, model, args, kwargs, fb: Refusal | PagedFallback | None = None):
    """Warn for ``fb`` (if given), then run stock ``generate``; paged calls it makes stay stock."""
    if fb is not None:
        warn_fallback(fb)
    token = _in_stock.set(True)
    try:
        return original(model, *args, **kwargs)
    finally:
        _in_stock.reset(token)


def in_stock() -> bool:
    """True inside stock ``generate`` run by ``call_stock`` (nested calls stay stock)."""
    return _in_stock.get()
