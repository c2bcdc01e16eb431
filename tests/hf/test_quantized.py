"""Quantized models and checkpoints the engine does not serve (it serves the FP8 formats of
``hf_paged.layers.quantization``; tests/models/test_fp8_checkpoints.py): a model or checkpoint
whose config carries another ``quantization_config`` never runs on it as if its weights were
plain. ``generate(backend="paged")`` and ``pipeline(..., backend="paged")`` run stock with a
``PagedFallbackWarning`` naming the method; ``LLM`` and ``AutoPagedModelForCausalLM`` raise a
ValueError naming it.

bitsandbytes / GPTQ / AWQ can't be loaded here, so the config is faked on a tiny fp32 model
(or in a checkpoint directory's config.json); stock generate still runs on its plain weights.
"fp8" is an FP8 variant the engine does not serve (UE8M0 scales), which stock transformers
loads on CPU by dequantizing.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import transformers

from hf_paged import LLM
from hf_paged.engine.servable import quantization_method
from hf_paged.integration import dispatch
from hf_paged.integration.auto import AutoPagedModelForCausalLM
from hf_paged.testing import (
    build_hf_model,
    fallback_warnings,
    left_pad,
    make_prompts,
    save_checkpoint,
)
from tests.hf.pipe_utils import GREEDY, PROMPTS, SMALL_ENGINE

METHODS = {
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True},
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": 128},
    "awq": {"quant_method": "awq", "bits": 4, "version": "gemm"},
    "fp8": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
    "compressed-tensors": {  # an int8 scheme: only its FP8 schemes are served
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True}}},
    },
}  # fmt: skip


def _no_engine(model, config):
    raise AssertionError("a quantized model must not reach the engine")


@pytest.fixture(scope="module")
def llama():
    return build_hf_model("llama", seed=0)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_generate_falls_back_naming_the_method(llama, method, monkeypatch):
    monkeypatch.setattr(dispatch, "engine_factory", _no_engine)
    ids, mask = left_pad(make_prompts([1, 4, 7]))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    stock = llama.generate(**kwargs)
    monkeypatch.setattr(llama.config, "quantization_config", dict(METHODS[method]), raising=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        paged = llama.generate(**kwargs, backend="paged")
    assert torch.equal(paged, stock)
    (message,) = fallback_warnings(rec)
    assert f"quant_method={method!r}" in message and f"[quantized_{method}]" in message


def test_fp8_config_over_plain_weights_is_served(llama, monkeypatch):
    """An in-memory model whose config names FP8 but whose weights are plain (transformers
    dequantized them at load: ``dequantize=True``) runs paged, as the plain model it is."""
    ids, mask = left_pad(make_prompts([1, 4, 7]))
    kwargs = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    stock = llama.generate(**kwargs)
    qc = {"quant_method": "fp8", "weight_block_size": [128, 128], "dequantize": True}
    monkeypatch.setattr(llama.config, "quantization_config", qc, raising=False)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        paged = llama.generate(**kwargs, backend="paged", paged_config=SMALL_ENGINE)
    assert torch.equal(paged, stock) and not fallback_warnings(rec)


def test_quantization_method_reads_configs_and_models(llama):
    assert quantization_method(llama) is None and quantization_method(llama.config) is None
    config = transformers.LlamaConfig()
    config.quantization_config = transformers.GPTQConfig(bits=4)  # a config object, an enum
    assert quantization_method(config) == "gptq"
    config.quantization_config = {"bits": 4}
    assert quantization_method(config) == "unknown"


@pytest.fixture(scope="module")
def quantized_ckpts(tmp_path_factory):
    """One tiny checkpoint per method, with the method's quantization_config in config.json."""
    paths = {}
    for method, qc in METHODS.items():
        path = save_checkpoint(str(tmp_path_factory.mktemp("quant") / method))
        cfg_file = os.path.join(path, "config.json")
        with open(cfg_file) as f:
            cfg = json.load(f)
        cfg["quantization_config"] = qc
        with open(cfg_file, "w") as f:
            json.dump(cfg, f)
        paths[method] = path
    return paths


@pytest.mark.parametrize("method", sorted(METHODS))
def test_llm_and_auto_model_refuse_naming_the_method(quantized_ckpts, method):
    pattern = f"quant_method='{method}' is not allowed"
    with pytest.raises(ValueError, match=pattern):
        LLM(quantized_ckpts[method], **SMALL_ENGINE)
    with pytest.raises(ValueError, match=pattern):
        AutoPagedModelForCausalLM.from_pretrained(quantized_ckpts[method], **SMALL_ENGINE)


def test_path_pipeline_falls_back_to_stock(quantized_ckpts, monkeypatch):
    """transformers loads an fp8 checkpoint on CPU by dequantizing it: stock can run it, the
    paged pipeline must run stock too (and say so)."""
    from hf_paged.integration.pipeline import install_pipeline

    install_pipeline()
    monkeypatch.setattr(dispatch, "engine_factory", _no_engine)
    path = quantized_ckpts["fp8"]
    stock = transformers.pipeline("text-generation", model=path, device="cpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        paged = transformers.pipeline("text-generation", model=path, device="cpu", backend="paged")
        assert paged(PROMPTS[:2], **GREEDY) == stock(PROMPTS[:2], **GREEDY)
    assert any("[quantized_fp8]" in m for m in fallback_warnings(rec))
    assert type(paged.model).__name__ == "LlamaForCausalLM"  # the stock HF model was loaded
