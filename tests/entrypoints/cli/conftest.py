"""Every CLI test runs with one torch thread and a clean ``generate`` dispatcher."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _cli_state(one_thread, clean_dispatch):
    """``one_thread`` and ``clean_dispatch`` (tests/conftest.py) for every test here."""
