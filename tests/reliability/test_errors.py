"""Fault 7 of issue 14: errors that name the cause and the next step (single process, CPU)."""

from __future__ import annotations

import os
import shutil

import pytest
import transformers

from hf_paged import LLM
from hf_paged.entrypoints.cli import main
from hf_paged.integration.pipeline import (
    install_pipeline,
    is_pipeline_installed,
    uninstall_pipeline,
)
from hf_paged.testing import save_demo_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_demo_model(str(tmp_path_factory.mktemp("err") / "demo"), seed=4)


def test_truncated_safetensors_names_the_file(ckpt, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        LLM(str(broken), max_model_len=64)
    message = str(err.value)
    assert str(weights) in message
    assert "truncated or corrupt" in message


def test_missing_local_path_is_not_called_a_hub_id(tmp_path):
    with pytest.raises(ValueError) as err:
        LLM(str(tmp_path / "nowhere"))
    assert "local checkpoint directory" in str(err.value)
    assert "Hub id" not in str(err.value)


def test_path_pipeline_default_max_new_tokens_over_max_model_len(ckpt):
    was = is_pipeline_installed()
    install_pipeline()
    try:
        pipe = transformers.pipeline(
            "text-generation", model=ckpt, backend="paged", device="cpu",
            paged_config={"max_model_len": 64, "num_kv_blocks": 16, "kv_block_size": 8},
        )  # fmt: skip
        with pytest.raises(ValueError) as err:
            pipe("Hello there")  # the pipeline's default max_new_tokens is 256
        message = str(err.value)
        assert "max_new_tokens=256" in message and "max_model_len=64" in message
        assert "pass max_new_tokens <=" in message
        out = pipe("Hello there", max_new_tokens=4, do_sample=False)  # the fix it names works
        assert out[0]["generated_text"].startswith("Hello there")
        pipe.model.close()
    finally:
        if not was:
            uninstall_pipeline()


def _cli(capsys, *argv) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_cli_over_long_prompt_is_a_usage_error(ckpt, capsys):
    code, err = _cli(
        capsys, "generate", ckpt, "--prompt", "x" * 200, "--max-model-len", "64",
        "--num-kv-blocks", "32", "--kv-block-size", "8",
    )  # fmt: skip
    assert code == 2
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("hf-paged generate: error:") and "64" in last


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["generate", "{ckpt}", "--prompt", "hi", "--max-tokens", "0"], "max_tokens"),
        (["generate", "{ckpt}", "--prompt", "hi", "--kv-block-size", "0"], "kv_block_size"),
        (["generate", "meta-llama/Llama-3-8B", "--prompt", "hi"], "Llama-3-8B"),
    ],
)
def test_cli_errors_are_one_line_exit_2(ckpt, capsys, argv, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, err = _cli(capsys, *[a.format(ckpt=ckpt) for a in argv])
    assert code == 2 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("hf-paged") and needle in lines[-1]
    assert len([line for line in lines if "error:" in line]) == 1


def test_hub_id_message_only_for_missing_paths(ckpt):
    assert os.path.isdir(ckpt)
    LLM(ckpt, max_model_len=32, num_kv_blocks=8, kv_block_size=8).close()  # a real dir loads
