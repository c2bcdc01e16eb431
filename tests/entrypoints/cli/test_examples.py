"""Every example runs (a subprocess each, all started together) and reports stock-equal output.

``examples/plain_script.py`` is run by ``test_cli.py`` (plain and under ``hf-paged run``)."""

from __future__ import annotations

import os

import pytest

from tests.entrypoints.cli.procs import finish, start_python

EXAMPLES = {
    "pipeline_dropin.py": ["same as stock: True", "string: [{'generated_text': 'Hello, my name is"],
    "datasets_map.py": ["same as stock: True", "'def fib(n):' -> "],
    "eval_harness.py": ["same as stock: True", "'x' -> "],
    "tensor_parallel.py": ["same as stock: True", "pipeline tp=2: ["],
}


@pytest.fixture(scope="module")
def runs():
    procs = {name: start_python([os.path.join("examples", name)]) for name in EXAMPLES}
    try:
        yield {name: finish(p) for name, p in procs.items()}
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_runs_and_matches_stock(runs, name):
    code, out, err = runs[name]
    assert code == 0, f"{name} exited with {code}:\n{err[-3000:]}"
    for expected in EXAMPLES[name]:
        assert expected in out, f"{name}: {expected!r} not in output:\n{out}"
    assert "PagedFallbackWarning" not in err
