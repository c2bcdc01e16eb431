"""The local lm-eval tasks of ``hf_paged.benchmarks.lm_eval_tasks``: issue 29's documents
(``evaluation/run_lm_eval_cli.py``'s ``issue_docs``) at a small scale, written as YAML + JSONL
that lm-eval's own task manager loads, with the request kind and document count asked for."""

from __future__ import annotations

import json

import pytest

from hf_paged.benchmarks.lm_eval_tasks import KINDS, agreement, samples, write_task
from tests.evaluation_scripts import load_evaluation_script

issue_docs = load_evaluation_script("run_lm_eval_cli").issue_docs


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


def _doc(i, resps, arguments=("ctx",)):
    return {"doc_id": i, "arguments": list(arguments), "resps": resps}


def test_agreement_of_two_runs(tmp_path):
    gen_a = [_doc(0, [["x"]]), _doc(1, [["y"]])]
    gen_b = [_doc(0, [["x"]]), _doc(1, [["z"]])]
    facts = agreement("generate_until", gen_a, gen_b)
    assert (facts["identical_strings"], facts["differing_docs"]) == (1, [1])
    mc_a = [_doc(0, [[["-1.0", "True"]], [["-2.0", "False"]]]),
            _doc(1, [[["-3.0", "False"]], [["-2.5", "True"]]])]  # fmt: skip
    mc_b = [_doc(0, [[["-1.00001", "True"]], [["-2.0", "False"]]]),
            _doc(1, [[["-2.0", "False"]], [["-2.5", "True"]]])]  # fmt: skip
    facts = agreement("multiple_choice", mc_a, mc_b)
    assert facts["same_choice"] == 0.5 and facts["all_finite"]
    assert facts["max_abs_loglikelihood_diff"] == 1.0
    assert facts["not_close"]["count"] == 1  # -3.0 vs -2.0; -1.0 vs -1.00001 is within 1e-4
    roll = agreement("loglikelihood_rolling", [_doc(0, [["-5.0"]])], [_doc(0, [["-inf"]])])
    assert not roll["all_finite"]
    assert agreement("multiple_choice", mc_a, mc_a[:1])["comparable"] is False
    # the newest samples file of a task under a run's output folder, in document order
    run = tmp_path / "model_dir"
    run.mkdir()
    (run / "samples_t_2026.jsonl").write_text("".join(
        json.dumps(d) + "\n" for d in reversed(gen_a)))  # fmt: skip
    assert samples(tmp_path, "t") == gen_a and samples(tmp_path, "other") == []
