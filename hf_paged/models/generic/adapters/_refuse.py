"""Adapters that refuse: for attention modules of models whose stock ``generate`` computes
something the paged engine cannot reproduce for a reason outside attention. The family module
registers ``refusing(reason)`` for the module class; the profile pass's first attention call
raises ``UnsupportedModelError(reason)``, so the fallback warning names the real reason instead
of "does not route attention through transformers' AttentionInterface"."""

from __future__ import annotations

from collections.abc import Callable

from hf_paged.models.protocol import UnsupportedModelError


def refusing(reason: str) -> Callable:
    """A forward that raises ``UnsupportedModelError(reason)`` whatever it is passed."""

    def forward(module, *args, **kwargs):
        raise UnsupportedModelError(reason)

    return forward
