"""``Refusal``: the one answer to "why can't this run on the paged engine?".

Every helper that judges a call, a model, a config or an option returns ``Refusal | None``
(None: it can run). The caller decides what a refusal becomes: the ``generate`` dispatcher and
the other front ends with a stock implementation raise it as ``PagedFallback`` and run stock
(``integration/fallback.py``); the engine and ``LLM``, which have nothing to fall back on, raise
``ValueError`` (or ``UnsupportedModelError``) with its text.

A plain value with no imports, so every level of the package (layers, models, engine,
integration) returns the same type.
"""

from __future__ import annotations

from typing import NamedTuple


class Refusal(NamedTuple):
    """Why something can't run paged.

    A named pair, so ``reason, detail = refusal`` unpacks it; ``str(refusal)`` is the detail
    alone (what a ``ValueError`` built from it says).
    """

    reason: str  # short key, e.g. "quantized_gptq", "architecture": one warning per key
    detail: str  # why, in words, and how to change the call where there is a way

    def __str__(self) -> str:
        return self.detail

    def tagged(self) -> str:
        """``"detail [reason]"``: the detail with its key, as error messages show both."""
        return f"{self.detail} [{self.reason}]"

    def renamed(self, prefix: str, what: str) -> Refusal:
        """The same refusal about a second object: ``prefix`` on the key and ``what`` before the
        detail (an assistant model's refusal as ``assistant_...``, "the assistant: ...")."""
        return Refusal(f"{prefix}{self.reason}", f"{what}{self.detail}")


__all__ = ["Refusal"]
