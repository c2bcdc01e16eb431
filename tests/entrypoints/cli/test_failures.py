"""How ``hf-paged`` fails: a refusal found at run time is one line, ``hf-paged <cmd>: error:
...``, without the usage block; what needs no model is checked before the model loads; a
mistyped option gets the command's own usage; ``--help`` has a line and a default for every
option."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.entrypoints.cli import build_parser
from hf_paged.testing import save_demo_model
from tests.entrypoints.cli.procs import REPO, run_cli

SMALL = ["--num-kv-blocks", "32", "--kv-block-size", "4", "--device", "cpu"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("fail") / "m"))


@pytest.fixture(scope="module")
def xlm(tmp_path_factory, ckpt):
    """A checkpoint no model path serves (XLM), with a tokenizer beside it."""
    import transformers as tf

    path = tmp_path_factory.mktemp("fail") / "xlm"
    tf.XLMWithLMHeadModel(tf.XLMConfig(emb_dim=64, n_layers=2, n_heads=4, vocab_size=128))\
        .save_pretrained(path)  # fmt: skip
    shutil.copy(f"{ckpt}/tokenizer.json", path)
    shutil.copy(f"{ckpt}/tokenizer_config.json", path)
    return str(path)


def _lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "/no/such/dir", "--prompt", "x"], "MODEL_PATH='/no/such/dir' is not allowed"),
        (["generate", "{ckpt}", "--prompt", "a b c d e f g h", "--max-model-len", "4", *SMALL],
         "prompt length"),
        (["generate", "{xlm}", "--prompt", "x", *SMALL], "XLMWithLMHeadModel: "),
        (["generate", "{ckpt}", "--prompt", "x", "--device", "cuda", "--num-kv-blocks", "32"],
         "device='cuda' is not allowed: CUDA is not available"),
        (["generate", "{ckpt}"], "no prompts"),
        (["bench", "/no/such/dir"], "MODEL_PATH='/no/such/dir' is not allowed"),
        (["run", "/no/such/script.py"], "script='/no/such/script.py' is not allowed: no such file"),
        (["run", "-m", "no_such_module_here"], "module='no_such_module_here' is not allowed: no such module"),
    ],
)  # fmt: skip
def test_a_refusal_is_one_line_without_the_usage(ckpt, xlm, capsys, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("CUDA is available here: nothing to refuse")
    argv = [a.format(ckpt=ckpt, xlm=xlm) for a in argv]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert len(_lines(err)) == 1, err
    assert err.startswith(f"hf-paged {argv[0]}: error: ") and message in err, err
    assert "usage:" not in err and "Traceback" not in err


def test_a_missing_module_fails_as_a_missing_script(capsys):
    _, _, script = run_cli(capsys, "run", "no_such_thing.py")
    _, _, module = run_cli(capsys, "run", "-m", "no_such_thing")
    assert script == "hf-paged run: error: script='no_such_thing.py' is not allowed: no such file\n"
    assert module == "hf-paged run: error: module='no_such_thing' is not allowed: no such module\n"


@pytest.mark.parametrize(
    "option, message",
    [
        (["--max-tokens", "0"], "max_tokens=0 is not allowed"),
        (["--top-p", "2"], "top_p=2.0 is not allowed"),
        (["--temperature", "-1"], "temperature=-1.0 is not allowed"),
        (["--max-num-seqs", "0"], "max_num_seqs=0 is not allowed"),
        (["--prompts-file", "/no/such/file"], "--prompts-file='/no/such/file' is not allowed"),
    ],
)
def test_cheap_arguments_are_checked_before_the_model_loads(ckpt, option, message):
    """In a fresh process: the refusal comes before torch is imported, so before any model."""
    code = (
        "import sys\nfrom hf_paged.entrypoints.cli import main\n"
        f"status = main({['generate', ckpt, '--prompt', 'x', *option]!r})\n"
        "print(status, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.stdout.split() == ["2", "False"], out.stdout + out.stderr
    assert message in out.stderr and len(_lines(out.stderr)) == 1, out.stderr


def test_a_mistyped_option_gets_the_commands_usage(ckpt, capsys):
    code, _, err = run_cli(capsys, "generate", ckpt, "--promt", "hi")
    assert code == 2
    assert err.startswith("usage: hf-paged generate "), err
    assert "hf-paged generate: error: unrecognized arguments: --promt hi" in err
    assert "did you mean --prompt?" in err


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: p for name, p in sub.choices.items() if name != "run"}


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_help_has_a_line_and_a_default_for_every_option(command):
    parser = _subcommands(build_parser())[command]
    text = parser.format_help()
    for action in parser._actions:
        if not action.option_strings or action.dest == "help":
            continue
        assert action.help and "(default: " in action.help, (action.option_strings, action.help)
        assert action.option_strings[0] in text


def test_run_help_has_a_line_and_a_default_for_every_option(capsys):
    code, out, _ = run_cli(capsys, "run", "--help")
    assert code == 0
    for option in ("--report", "--timings FILE", "--backend paged|hf", "-m module"):
        line = next((line for line in out.splitlines() if line.strip().startswith(option)), None)
        assert line is not None, (option, out)
    assert out.count("(default: ") >= 4


def test_top_level_help_says_what_the_switch_needs(capsys):
    code, out, _ = run_cli(capsys, "--help")
    assert code == 0
    assert "HF_PAGED_BACKEND=paged" in out and "hf_paged_backend.pth" in out
    assert "`import hf_paged` or `hf-paged run`" in out.replace("\n", " ")


def test_generate_stop_ends_at_the_stop_text_as_llm_does(ckpt, capsys):
    with LLM(ckpt, num_kv_blocks=32, kv_block_size=4, device="cpu") as llm:
        greedy = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0),
                              use_tqdm=False)[0].outputs[0].text  # fmt: skip
        stop = greedy[3:5]
        assert stop.strip(), greedy
        ref = llm.generate("Hello", SamplingParams(max_tokens=12, temperature=0, stop=[stop]),
                           use_tqdm=False)[0].outputs[0]  # fmt: skip
    code, out, err = run_cli(capsys, "generate", ckpt, "--prompt", "Hello", "--max-tokens", "12",
                             "--temperature", "0", "--stop", stop, *SMALL)  # fmt: skip
    assert code == 0, err
    row = json.loads(out)
    assert row["finish_reason"] == "stop" == ref.finish_reason
    assert row["text"] == ref.text and row["token_ids"] == ref.token_ids
    assert len(row["token_ids"]) < 12
