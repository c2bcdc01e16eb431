"""``hf-paged generate | run | bench``: output equal to ``LLM``, ``run`` equal to plain python
and served by the engine, a benchmark table, and errors that name the bad argument."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.integration import dispatch
from hf_paged.testing import save_checkpoint
from tests.entrypoints.cli.procs import REPO, finish, run_cli, start_python

ENGINE_ARGS = ["--num-kv-blocks", "64", "--kv-block-size", "4", "--device", "cpu"]
PLAIN = os.path.join("examples", "plain_script.py")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("cli") / "llama"))


@pytest.fixture(scope="module", autouse=True)
def plain_procs(ckpt):
    """The plain program run by python and by ``hf-paged run --report``, started when the module
    starts so that they overlap the in-process tests."""
    procs = {
        "python": start_python([PLAIN, ckpt]),
        "hf-paged": start_python(
            ["-m", "hf_paged.entrypoints.cli", "run", "--report", PLAIN, ckpt]
        ),
    }
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.fixture(scope="module")
def plain_runs(plain_procs):
    return {name: finish(p) for name, p in plain_procs.items()}


# ---- generate -----------------------------------------------------------------------------------


def test_generate_json_lines_equal_llm(ckpt, tmp_path, capsys):
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text('plain line\n\n{"prompt": "from json", "id": 7}\n')
    code, out, err = run_cli(
        capsys, "generate", ckpt, "--prompt", "Hello", "--prompt", "ab",
        "--prompts-file", str(prompts_file), "--max-tokens", "6", "--temperature", "0",
        "--in-order", *ENGINE_ARGS,
    )  # fmt: skip
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    prompts = ["Hello", "ab", "plain line", "from json"]
    with LLM(ckpt, num_kv_blocks=64, kv_block_size=4, device="cpu") as llm:
        ref = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)
    assert rows == [
        {
            "index": i,
            "prompt": p,
            "text": r.outputs[0].text,
            "token_ids": r.outputs[0].token_ids,
            "finish_reason": r.outputs[0].finish_reason,
        }
        for i, (p, r) in enumerate(zip(prompts, ref, strict=True))
    ]


def test_generate_seeded_sampling_equals_llm(ckpt, capsys):
    args = ["--max-tokens", "5", "--temperature", "0.9", "--top-k", "20", "--top-p", "0.9"]
    code, out, err = run_cli(
        capsys, "generate", ckpt, "--prompt", "a", "--prompt", "a", "--seed", "11", *args,
        *ENGINE_ARGS,
    )  # fmt: skip
    assert code == 0, err
    rows = sorted(map(json.loads, out.splitlines()), key=lambda row: row["index"])
    got = [row["token_ids"] for row in rows]
    with LLM(ckpt, num_kv_blocks=64, kv_block_size=4, device="cpu") as llm:
        params = [
            SamplingParams(max_tokens=5, temperature=0.9, top_k=20, top_p=0.9, seed=11 + i)
            for i in range(2)
        ]
        ref = llm.generate(["a", "a"], params, use_tqdm=False)
    assert got == [r.outputs[0].token_ids for r in ref]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "/no/such/dir", "--prompt", "x"], r"MODEL_PATH='/no/such/dir' is not allowed"),
        (["generate", "{ckpt}"], r"no prompts: give --prompt"),
        (["generate", "{ckpt}", "--prompts-file", "/no/file"], r"--prompts-file='/no/file' is not allowed"),
        (["generate", "{ckpt}", "--prompts-file", "{bad_json}"], r"line 2 is not valid JSON"),
        (["generate", "{ckpt}", "--prompts-file", "{no_prompt}"], r'line 1 is not allowed: .*"prompt"'),
        (["generate", "{ckpt}", "--prompt", "x", "--top-p", "2"], r"top_p=2.0 is not allowed"),
        (["generate", "{ckpt}", "--prompt", "x", "--max-num-seqs", "0"], r"max_num_seqs=0 is not allowed"),
        (["generate", "{ckpt}", "--prompt", "x", "--dtype", "int8"], r"--dtype: invalid choice: 'int8'"),
        (["bench", "{ckpt}", "--min-output-len", "9", "--max-output-len", "3"], r"--max-output-len=3 is not allowed: must be >= --min-output-len=9"),
        (["bench", "{ckpt}", "--num-requests", "0"], r"--num-requests=0 is not allowed"),
        (["run"], r"run: error: missing the program"),
        (["run", "/no/script.py"], r"run: error: script='/no/script.py' is not allowed: no such file"),
        (["run", "-m"], r"-m needs a module name"),
        (["run", "-m", "no_such_module_here"], r"run: error: module='no_such_module_here' is not allowed: no such module"),
        (["run", "--fast", "x.py"], r"option '--fast' is not allowed: options are --report, --timings FILE, --backend paged\|hf, -m"),
        (["run", "--backend", "vllm", "x.py"], r"--backend='vllm' is not allowed: one of paged, hf"),
        (["run", "--timings"], r"--timings needs a value"),
    ],
)  # fmt: skip
def test_bad_input_names_the_argument(ckpt, tmp_path, capsys, argv, message):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": \n')
    no_prompt = tmp_path / "no_prompt.jsonl"
    no_prompt.write_text('{"text": "x"}\n')
    argv = [a.format(ckpt=ckpt, bad_json=bad_json, no_prompt=no_prompt) for a in argv]
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert re.search(message, err), err


# ---- run ----------------------------------------------------------------------------------------


def test_run_gives_the_plain_outputs_and_the_engine_served_them(plain_runs):
    code, out, err = plain_runs["python"]
    paged_code, paged_out, paged_err = plain_runs["hf-paged"]
    assert code == 0, err
    assert paged_code == 0, paged_err
    assert out.count("generate:") == 3 and out.count("pipeline:") == 3
    assert paged_out == out
    # 1 batched generate + the pipeline's 3 prompts, one batch each; a fallback would not count
    assert "served by the paged engine: 1 generate call(s), 3 pipeline batch(es)" in paged_err
    assert "PagedFallbackWarning" not in paged_err


def test_run_module_sets_argv_env_and_exit_code(monkeypatch, capsys):
    monkeypatch.setenv(dispatch.ENV_VAR, "hf")  # restored after the test
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    code, out, err = run_cli(
        capsys, "run", "--report", "-m", "tests.entrypoints.cli.pipe_run_target", "a", "exit=3"
    )
    assert code == 3
    seen = json.loads(out)
    assert seen["argv"][0].endswith(os.path.join("cli", "pipe_run_target.py"))
    assert seen["argv"][1:] == ["a", "exit=3"]
    assert seen["name"] == "__main__" and seen["backend"] == "paged"
    assert seen["path0"] == os.getcwd()
    assert "hf_paged: served by the paged engine: 0 generate call(s)" in err


def test_run_script_path(monkeypatch, capsys):
    monkeypatch.setenv(dispatch.ENV_VAR, "hf")
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    script = os.path.join(REPO, "tests", "entrypoints", "cli", "pipe_run_target.py")
    code, out, _ = run_cli(capsys, "run", script, "--flag")
    assert code == 0
    seen = json.loads(out)
    assert seen["argv"] == [script, "--flag"] and seen["path0"] == os.path.dirname(script)


# ---- bench --------------------------------------------------------------------------------------


BENCH = [
    "--num-requests", "3", "--min-input-len", "4", "--max-input-len", "9",
    "--min-output-len", "2", "--max-output-len", "5", "--hf-batch-size", "2",
]  # fmt: skip


def test_bench_table(ckpt, capsys):
    code, out, err = run_cli(capsys, "bench", ckpt, *BENCH, *ENGINE_ARGS)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[1].split() == ["backend", "requests", "out_tokens", "seconds", "tok/s", "vs", "hf"]
    hf, paged = lines[2].split(), lines[3].split()
    assert hf[0] == "hf" and paged[0] == "paged" and hf[2] == paged[2]
    assert hf[-1] == "1.00x" and paged[-1].endswith("x")


def test_bench_json_paged_only(ckpt, capsys):
    code, out, err = run_cli(capsys, "bench", ckpt, *BENCH, "--skip-hf", "--json", *ENGINE_ARGS)
    assert code == 0, err
    result = json.loads(out)
    assert result["device"] == "cpu"
    (row,) = result["results"]
    assert row["backend"] == "paged" and row["requests"] == 3 and row["tok_per_s"] > 0
    assert row["vs_hf"] is None
