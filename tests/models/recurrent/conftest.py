"""The one fixture of the recurrent mixer tests: ``case``, our mixer beside the stock module it
stands in for and the model's config, built once per module for the family (and device) that
an indirect parameter names."""

from __future__ import annotations

import pytest

from tests.models.recurrent.ssm_cases import build_module, mixer_for


@pytest.fixture(scope="module")
def case(request):
    """``(our mixer, the stock module, the config)`` of ``request.param``: a family of
    ``ssm_cases.FAMILIES`` (on the CPU) or ``(family, device)``."""
    family, device = request.param if isinstance(request.param, tuple) else (request.param, "cpu")
    module, config = build_module(family)
    module = module.to(device)
    return mixer_for(family, module), module, config
