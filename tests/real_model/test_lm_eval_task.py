"""lm-eval on the paged engine scores the demo model exactly as stock lm-eval does, on a local
multiple-choice task shipped here (``tasks/demo_quiz``: 24 questions, 4 choices each): the same
accuracy and, request by request, the same log-likelihoods up to fp32 rounding and the same
greedy flags. Both runs are in this process, stock first, then with the paged backend switched on.
"""

from __future__ import annotations

import math
import os

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")

pytestmark = pytest.mark.real_model

TASKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def _evaluate(model, tokenizer, include_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=8)
    return lm_eval.simple_evaluate(model=lm, tasks=["demo_quiz"], log_samples=True,
                                   task_manager=TaskManager(include_path=include_path))  # fmt: skip


def test_lm_eval_scores_equal_stock(stock_fp32, demo_tokenizer, tmp_path, clean_dispatch):
    from hf_paged import set_default_backend
    from hf_paged.integration.lm_eval.install import install_lm_eval, uninstall_lm_eval

    with open(os.path.join(TASKS, "demo_quiz.yaml")) as f:  # the data file's absolute path
        yaml = f.read().replace("tests/real_model/tasks/", TASKS + "/")
    (tmp_path / "demo_quiz.yaml").write_text(yaml)
    stock = _evaluate(stock_fp32, demo_tokenizer, str(tmp_path))
    install_lm_eval()
    try:
        set_default_backend("paged")
        paged = _evaluate(stock_fp32, demo_tokenizer, str(tmp_path))
    finally:
        set_default_backend(None)
        uninstall_lm_eval()
    want, got = stock["results"]["demo_quiz"], paged["results"]["demo_quiz"]
    assert len(stock["samples"]["demo_quiz"]) == 24
    assert 0.3 < want["acc,none"] < 1.0  # a real model, better than chance, not perfect
    for key in ("acc,none", "acc_norm,none"):
        assert got[key] == want[key], key
    for s, p in zip(stock["samples"]["demo_quiz"], paged["samples"]["demo_quiz"]):
        assert s["doc_id"] == p["doc_id"]
        for (ll_s, greedy_s), (ll_p, greedy_p) in zip(s["filtered_resps"], p["filtered_resps"]):
            assert greedy_p == greedy_s
            assert math.isclose(ll_p, ll_s, rel_tol=1e-4, abs_tol=1e-4)
