"""What a new user meets first through the Python API: ``hf_paged.release``, a hub id passed as a
path, ``llm.generate(123)``, a mistyped ``HF_PAGED_*`` variable, ``hf_paged.ray`` without
ray."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import hf_paged
from hf_paged import LLM, AutoPagedModelForCausalLM
from hf_paged.testing import save_demo_model

ROOT = Path(__file__).resolve().parents[2]
# the pipeline entry patches transformers.pipeline: one torch thread and a clean dispatcher
pytestmark = pytest.mark.usefixtures("one_thread", "clean_dispatch")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_demo_model(str(tmp_path_factory.mktemp("first") / "m"))
    with LLM(path, num_kv_blocks=32) as llm:
        yield llm


def test_release_is_public():
    assert callable(hf_paged.release) and callable(hf_paged.configure)


@pytest.mark.parametrize("entry", ["LLM", "AutoPagedModelForCausalLM", "pipeline"])
def test_hub_id_gets_the_download_hint(entry):
    hub_id = "someorg/some-model-that-is-not-here"
    with pytest.raises(ValueError, match="looks like a Hugging Face Hub id") as info:
        if entry == "LLM":
            LLM(hub_id)
        elif entry == "AutoPagedModelForCausalLM":
            AutoPagedModelForCausalLM.from_pretrained(hub_id)
        else:
            import transformers

            transformers.pipeline("text-generation", model=hub_id, backend="paged")
    assert "download" in str(info.value) and hub_id in str(info.value)


@pytest.mark.parametrize("bad", [123, 1.5, None, {"a": 1}])
def test_generate_with_a_non_prompt_names_the_argument(llm, bad):
    # a dict is a prompt's type (vLLM's {"prompt": ...}); its keys are the wrong value
    error = ValueError if isinstance(bad, dict) else TypeError
    with pytest.raises(error, match="prompts=.* is not allowed"):
        llm.generate(bad)
    assert not llm.engine.has_unfinished_requests()


def test_mistyped_switch_is_warned_about_at_import():
    env = {**os.environ, "HF_PAGED_BACKND": "paged"}
    code = "import warnings; warnings.simplefilter('always'); import hf_paged"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         cwd=ROOT)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "HF_PAGED_BACKND is set but is not an hf_paged switch" in out.stderr
    assert "did you mean HF_PAGED_BACKEND?" in out.stderr


def test_ray_module_without_ray_says_how_to_install():
    code = "import sys; sys.modules['ray'] = None; from hf_paged import ray"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0
    assert "hf_paged.ray needs ray[data]" in out.stderr and "pip install" in out.stderr


# a stand-in ray package: enough for hf_paged.ray to import (its body needs ray only when run)
_FAKE_RAY = "import sys, types; sys.modules['ray'] = types.ModuleType('ray'); "


@pytest.mark.parametrize(
    "code",
    ["import hf_paged.ray; f = hf_paged.ray.map_generate",
     "from hf_paged.ray import map_generate as f",
     "import hf_paged; f = hf_paged.ray.map_generate"],
    ids=["import-module", "from-import", "attribute"],
)  # fmt: skip
def test_ray_module_import_forms(code):
    """The README's ``import hf_paged.ray`` / ``from hf_paged.ray import map_generate`` and the
    attribute form all reach the same function."""
    probe = f"{_FAKE_RAY}{code}; from hf_paged.entrypoints.ray import map_generate; " \
            "print(f is map_generate)"  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "True"


def test_import_hf_paged_ray_without_ray_says_how_to_install():
    code = "import sys; sys.modules['ray'] = None; import hf_paged.ray"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode != 0
    assert "hf_paged.ray needs ray[data]" in out.stderr and "pip install" in out.stderr


def test_help_works_without_ray():
    """``help(hf_paged)`` renders the package docstring where ray is not installed."""
    code = ("import sys, pydoc; sys.modules['ray'] = None; import hf_paged; "
            "print(pydoc.render_doc(hf_paged, renderer=pydoc.plaintext))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "a paged-KV engine behind Hugging Face" in out.stdout
    assert "LLMEngine" in out.stdout


def _save_tiny(kind: str, path: Path) -> str:
    """A tiny non-decoder checkpoint: ``bert`` (saved as ``BertModel``, an encoder with no LM
    head) or ``xlm`` (``XLMWithLMHeadModel``, which stock generates with by re-running a mask
    token)."""
    import transformers as tf

    if kind == "bert":
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, vocab_size=128)  # fmt: skip
        tf.BertModel(cfg).save_pretrained(path)
    else:
        cfg = tf.XLMConfig(emb_dim=64, n_layers=2, n_heads=4, vocab_size=128)
        tf.XLMWithLMHeadModel(cfg).save_pretrained(path)
    return str(path)


def test_an_encoder_checkpoint_is_called_no_causal_lm(tmp_path):
    """A ``BertModel`` checkpoint was blamed on 'unexpected weights' (its pooler): it is no
    causal LM, and the message says so as it does for T5."""
    with pytest.raises(ValueError) as info:
        LLM(_save_tiny("bert", tmp_path / "bert"), device="cpu", num_kv_blocks=16)
    message = str(info.value)
    assert "'BertModel' is not a transformers causal LM" in message, message
    assert "unexpected weights" not in message


def test_a_refused_model_is_named(tmp_path):
    with pytest.raises(ValueError) as info:
        LLM(_save_tiny("xlm", tmp_path / "xlm"), device="cpu", num_kv_blocks=16)
    message = str(info.value)
    assert message.startswith("XLMWithLMHeadModel: "), message
    assert "mask token" in message


@pytest.mark.parametrize("hub_id", ["gpt2", "meta-llama/Llama-3-8B"])
def test_a_bare_hub_id_gets_the_download_hint(tmp_path, monkeypatch, hub_id):
    monkeypatch.chdir(tmp_path)  # no local directory of that name here
    with pytest.raises(ValueError) as info:
        LLM(hub_id)
    message = str(info.value)
    assert f"{hub_id!r} looks like a Hugging Face Hub id" in message
    assert "downloads nothing" in message and "local directory" in message
    assert f"huggingface-cli download {hub_id} --local-dir DIR" in message
    assert "hf-paged fetch-demo-model" in message


def test_a_dict_of_sampling_params_is_called_a_dict(llm):
    with pytest.raises(TypeError) as info:
        llm.generate("hi", {"max_tokens": 3, "temperature": 0})
    message = str(info.value)
    assert "sampling_params=<dict with keys ['max_tokens', 'temperature']>" in message
    assert "SamplingParams(**params)" in message
    assert not llm.engine.has_unfinished_requests()
