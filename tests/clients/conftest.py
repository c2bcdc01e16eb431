"""Fixtures of the client suite (``-m clients``; see suite.py): the size, the checkpoint (built
in a fresh process), the prompts, the stock reference and the session's result file."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest

from tests.clients.suite import REPO, TARGETS, Results, current_size, random_text, run_one


def pytest_collection_modifyitems(config, items):
    """The suite runs only when asked for (``-m clients``): a bare ``pytest`` stays fast."""
    if "clients" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="the client suite runs with -m clients (make test-clients, "
                            "make test-gpu-clients)")  # fmt: skip
    for item in items:
        # the marker, not the keyword: every item under tests/clients has the folder's name
        # among its keywords, and the suite's own unit tests (test_suite.py) run in `make test`
        if item.get_closest_marker("clients") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def size():
    return current_size()


@pytest.fixture(scope="session")
def workroot(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("clients")


@pytest.fixture(scope="session")
def results(size, workroot):
    default = REPO / "evaluation" / "results" if size.name == "gpu" else workroot / "results"
    res = Results(size, Path(os.environ.get("CLIENTS_RESULTS_DIR") or default))
    yield res
    print(f"\nclient suite results: {res.path}")


@pytest.fixture(scope="session")
def checkpoint(size, workroot) -> str:
    out = workroot / "checkpoint"
    cmd = [sys.executable, TARGETS / "build_checkpoint.py", "--size", size.name, "--out", out]
    run_one(size, "build_checkpoint", "setup", cmd, workroot)
    return str(out)


@pytest.fixture(scope="session")
def prompts(size, workroot) -> Path:
    """``size.prompts`` texts of 8 to 48 characters (tokens), as a JSON file."""
    rng = random.Random(23)
    texts = [random_text(rng, rng.randint(8, 48)) for _ in range(size.prompts)]
    path = workroot / "prompts.json"
    path.write_text(json.dumps(texts))
    return path


@pytest.fixture(scope="session")
def stock_reference(size, workroot, checkpoint, prompts, results):
    """Stock HF ``generate`` on each prompt alone: what every row-wise client must give."""
    out = workroot / "stock_reference.json"
    cmd = [sys.executable, TARGETS / "stock_generate.py", "--model", checkpoint, "--prompts",
           prompts, "--new-tokens", size.new_tokens, "--device", size.device, "--dtype",
           size.dtype, "--out", out]  # fmt: skip
    run = run_one(size, "stock_reference", "stock", cmd, workroot)
    results.add("stock_reference", [run], prompts=size.prompts, new_tokens=size.new_tokens)
    return json.loads(out.read_text()), run
