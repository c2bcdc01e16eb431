"""What a new user meets first on the command line: ``--version``, the sampling note, ``run``
without ``-m``, a tensor-parallel size the model cannot split, the ``--report`` of an lm-eval
run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hf_paged import __version__
from hf_paged.entrypoints.cli import main
from hf_paged.testing import save_demo_model

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("cli") / "m"))


def _cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = _cli(capsys, "--version")
    assert code == 0 and out.strip() == f"hf-paged {__version__}"


def test_generate_says_it_samples(ckpt, capsys):
    code, _, err = _cli(capsys, "generate", ckpt, "--prompt", "Hi", "--max-tokens", "2",
                        "--num-kv-blocks", "32")  # fmt: skip
    assert code == 0
    assert "sampling at temperature 1.0" in err and "--temperature 0" in err
    code, _, err = _cli(capsys, "generate", ckpt, "--prompt", "Hi", "--max-tokens", "2",
                        "--temperature", "0", "--num-kv-blocks", "32")  # fmt: skip
    assert code == 0 and "sampling" not in err


def test_run_suggests_dash_m_for_a_module(capsys):
    code, _, err = _cli(capsys, "run", "json", "x")
    assert code == 2
    assert "script='json' is not allowed: no such file" in err
    assert "hf-paged run -m json x" in err


def test_run_of_a_missing_file_has_no_module_hint(capsys):
    code, _, err = _cli(capsys, "run", "no_such_file_here.py")
    assert code == 2 and "no such file" in err and "-m" not in err.split("no such file")[1]


def test_tensor_parallel_size_that_does_not_split_is_refused_before_workers(ckpt, capsys):
    """The demo model has 4 query heads and 2 KV heads: tp=3 splits neither. One usage line
    names the sizes that work, at once (no worker is started)."""
    code, _, err = _cli(capsys, "generate", ckpt, "--prompt", "Hi", "--tensor-parallel-size",
                        "3", "--num-kv-blocks", "32", "--temperature", "0")  # fmt: skip
    assert code == 2
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    assert "tensor_parallel_size=3 is not allowed" in lines[0]
    assert "one of [1, 2" in lines[0]
    assert "Traceback" not in err


def test_report_counts_lm_eval_requests(ckpt, tmp_path):
    """``hf-paged run --report -m lm_eval`` counts the harness's requests, not only generate
    calls (it said "0 generate call(s)" while every request ran on the engine)."""
    pytest.importorskip("lm_eval")
    task = tmp_path / "tasks"
    task.mkdir()
    (task / "docs.jsonl").write_text(
        "\n".join(f'{{"text": "a b c d e f {i}"}}' for i in range(3)) + "\n"
    )
    (task / "tiny_rolling.yaml").write_text(
        "task: tiny_rolling\ndataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {task / 'docs.jsonl'}\n"
        "test_split: test\noutput_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
    )
    cmd = [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", "--report", "-m", "lm_eval",
           "--model", "hf", "--model_args", f"pretrained={ckpt},dtype=float32",
           "--tasks", "tiny_rolling", "--include_path", str(task), "--device", "cpu",
           "--batch_size", "1"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = [line for line in out.stderr.splitlines() if "served by the paged engine" in line]
    assert report and "0 lm-eval request(s)" not in report[-1], out.stderr[-2000:]
    assert "hf_paged: starting an engine (first use)" in out.stderr
