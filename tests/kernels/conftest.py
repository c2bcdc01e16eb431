"""The kernel tests' one interpreter fixture, ``interpreted``: the module's ``CASES`` run under
Triton's CPU interpreter in one child process (``interpret_utils``), once per module. A module
sets ``INTERPRET_TIMEOUT_S`` where its cases need other than 600 s."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import CaseResults, run_interpreter_cases


@pytest.fixture(scope="module")
def interpreted(request) -> CaseResults:
    """``{case: float}`` of the requesting module; a case that raised in the child fails its
    test with the child's traceback."""
    timeout = getattr(request.module, "INTERPRET_TIMEOUT_S", 600)
    return CaseResults(run_interpreter_cases(request.module.__file__, timeout=timeout))
