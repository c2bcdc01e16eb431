"""``timing/client.py``: ``import hf_paged``'s one install (``hooks.install_on_import``) wraps
the client's phases as spans when ``HF_PAGED_TIMINGS`` names a file, in either import order,
and wraps nothing without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = (
    "{first}\n{second}\n"
    "from transformers.pipelines.text_generation import TextGenerationPipeline as P\n"
    "print(getattr(P.__call__, '_hf_paged_span', None), getattr(P.preprocess, '_hf_paged_span', "
    "None))"
)
ORDERS = [("import hf_paged", "import transformers.pipelines.text_generation"),
          ("import transformers.pipelines.text_generation", "import hf_paged")]  # fmt: skip


def _spans(env_file: str | None, first: str, second: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "HF_PAGED_TIMINGS"}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    if env_file is not None:
        env["HF_PAGED_TIMINGS"] = env_file
    code = PROBE.format(first=first, second=second)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("first, second", ORDERS, ids=["hf_paged-first", "transformers-first"])
def test_the_switch_wraps_the_client_phases(tmp_path, first, second):
    assert _spans(str(tmp_path / "t.jsonl"), first, second) == "client.requests client.tokenize"


def test_without_the_switch_nothing_is_wrapped():
    assert _spans(None, *ORDERS[0]) == "None None"
