"""Helpers for the pipeline / datasets / CLI / examples tests: a tiny checkpoint on disk with a
tokenizer that decodes every id, stock references, and subprocess plumbing."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import transformers

from hf_paged.cli.run import ServedCounter
from hf_paged.integration.pipeline import (
    install_pipeline,
    is_pipeline_installed,
    uninstall_pipeline,
)
from hf_paged.testing import build_char_tokenizer, save_tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# small enough to build in milliseconds; 4-token blocks and 16-token steps exercise paging and
# chunked prefill even on these short prompts
SMALL_ENGINE = dict(
    device="cpu", num_kv_blocks=96, kv_block_size=4, max_num_seqs=4, max_num_batched_tokens=16
)
GREEDY = dict(max_new_tokens=8, do_sample=False)
PROMPTS = ["Hello, my name is", "ab", "The capital of France is", "def fib(n):", "x y z"]
CHAT = [{"role": "user", "content": "Tell me a joke."}]


def build_tokenizer():
    """The char tokenizer padded to the tiny models' 256 ids (every emitted id decodes)."""
    return build_char_tokenizer(256)


def save_checkpoint(path: str, family: str = "llama", seed: int = 0) -> str:
    """A tiny random checkpoint + tokenizer in ``path`` (llama seed 0 emits varied tokens)."""
    save_tiny_model(family, path, seed=seed)
    build_tokenizer().save_pretrained(path)
    return path


# module-scoped fixtures of the pipeline test files (import them by name into the module)
@pytest.fixture(scope="module", autouse=True)
def pipeline_wrapper():
    """``transformers.pipeline`` patched for the module, restored after it if it was not."""
    was = is_pipeline_installed()
    install_pipeline()
    yield
    if not was:
        uninstall_pipeline()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("pipe") / "llama"))


@pytest.fixture(scope="module")
def stock_pipe(ckpt, pipeline_wrapper):
    return transformers.pipeline("text-generation", model=ckpt, device="cpu")


@pytest.fixture
def counter():
    """Counts the engine's calls during one test."""
    c = ServedCounter()
    c.install()
    yield c
    c.uninstall()


def stock_new_text(model, tokenizer, prompt, **generate_kwargs) -> str:
    """What stock ``generate`` gives ``prompt`` alone: its new tokens, decoded."""
    if isinstance(prompt, str):
        enc = tokenizer(prompt, return_tensors="pt")
    else:
        enc = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
    with torch.no_grad():
        out = model.generate(**enc, **generate_kwargs)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)


def start_python(args: list[str], env: dict | None = None) -> subprocess.Popen:
    """``python ARGS`` from the repo root with the repo importable; read with ``finish``."""
    full_env = {**os.environ, "PYTHONPATH": REPO, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    full_env.pop("HF_PAGED_BACKEND", None)
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=REPO,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str]:
    """``(returncode, stdout, stderr)``; kills the process on timeout."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return proc.returncode, out, err
