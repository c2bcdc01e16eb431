"""The local lm-eval tasks of ``hf_paged.benchmarks.lm_eval_tasks``: issue 29's documents
(``evaluation/run_lm_eval_cli.py``'s ``issue_docs``) at a small scale, written as YAML + JSONL
that lm-eval's own task manager loads, with the request kind and document count asked for."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hf_paged.benchmarks.lm_eval_tasks import KINDS, write_task

_spec = importlib.util.spec_from_file_location(
    "run_lm_eval_cli", Path(__file__).resolve().parents[2] / "evaluation/run_lm_eval_cli.py"
)
_cli = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_cli)
issue_docs = _cli.issue_docs


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # lm-eval 0.4.13 get_task_dict
@pytest.mark.parametrize("kind", KINDS)
def test_tasks_load_in_lm_eval(kind, tmp_path):
    tasks = pytest.importorskip("lm_eval.tasks", reason="lm_eval is not installed")
    docs = issue_docs(kind, scale=0.02)
    write_task(tmp_path, f"t_{kind}", kind, docs, max_gen_toks=7)
    manager = tasks.TaskManager(include_path=str(tmp_path))
    task = tasks.get_task_dict([f"t_{kind}"], manager)[f"t_{kind}"]
    assert task.OUTPUT_TYPE == kind
    assert len(list(task.test_docs())) == len(docs)
    if kind == "generate_until":
        assert task.config.generation_kwargs["max_gen_toks"] == 7
        assert len({d["question"].split("\nQ")[0] for d in docs}) == 1  # the shared prefix


def test_issue_sizes_and_a_bad_kind():
    assert len(issue_docs("multiple_choice")) == 1000
    assert all(len(d["choices"]) == 4 for d in issue_docs("multiple_choice", scale=0.01))
    assert len(issue_docs("loglikelihood_rolling")) == 100
    with pytest.raises(ValueError, match="kind='mc' is not allowed"):
        issue_docs("mc")
    with pytest.raises(ValueError, match="kind='mc' is not allowed"):
        write_task(".", "x", "mc", [])
