"""``marked``: a list of pytest marks applied to one test, for a test file whose tests run on
different hardware (the marks say which: ``gpu``, ``multi_gpu`` and their skips), so that one
concept's tests live in one file whatever they run on."""

from __future__ import annotations


def marked(marks):
    """A decorator applying ``marks`` (one pytest mark or a list of them) to a test."""

    def apply(fn):
        for mark in reversed(marks if isinstance(marks, list) else [marks]):
            fn = mark(fn)
        return fn

    return apply
