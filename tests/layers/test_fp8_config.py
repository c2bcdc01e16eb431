"""FP8 ``quantization_config`` parsing: the two served formats, the one place that refuses the
rest (with the method named), and which modules each format quantizes (transformers'
``should_convert_module``, compressed-tensors' ``ignore``)."""

from __future__ import annotations

import pytest
import transformers
from transformers.quantizers.quantizers_utils import should_convert_module

from hf_paged.layers.quantization import fp8_config_of, unserved_quantization
from hf_paged.layers.quantization.fp8_checkpoints import compressed_tensors_config
from hf_paged.layers.quantization.fp8_config import (
    UnsupportedQuantizationError,
    layer_quant,
    parse_fp8,
)


def _config(qc):
    config = transformers.LlamaConfig()
    config.quantization_config = qc
    return config


def test_transformers_finegrained_config_object_and_dict():
    obj = transformers.FineGrainedFP8Config(weight_block_size=(128, 128))
    for qc in (obj, obj.to_dict()):
        cfg = fp8_config_of(_config(qc))
        assert (cfg.method, cfg.strategy, cfg.block, cfg.dynamic) == ("fp8", "block", (128, 128),
                                                                         True)  # fmt: skip
        assert cfg.scale_name == "weight_scale_inv" and cfg.input_scale_name is None
    per_tensor = parse_fp8({"quant_method": "fp8", "weight_block_size": None,
                            "activation_scheme": "static"})  # fmt: skip
    assert per_tensor.strategy == "tensor" and per_tensor.input_scale_name == "activation_scale"
    assert parse_fp8({"quant_method": "fp8", "dequantize": True}) is None  # plain weights


def test_compressed_tensors_presets():
    dyn = parse_fp8(compressed_tensors_config("channel", True, ["lm_head"]))
    assert (dyn.strategy, dyn.dynamic, dyn.scale_name) == ("channel", True, "weight_scale")
    static = parse_fp8(compressed_tensors_config("tensor", False, ["lm_head"]))
    assert (static.strategy, static.dynamic, static.input_scale_name) == ("tensor", False,
                                                                          "input_scale")  # fmt: skip


def _ct(**changes):
    qc = compressed_tensors_config("channel", True, ["lm_head"])
    group = qc["config_groups"]["group_0"]
    for key, value in changes.items():
        if key in ("weights", "input_activations"):
            group[key] = {**group[key], **value}
        else:
            qc[key] = value
    return qc


@pytest.mark.parametrize(
    "qc,words",
    [
        ({"quant_method": "gptq", "bits": 4}, "quant_method='gptq' is not served"),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "scale_fmt='ue8m0'"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme='static'"),
        (_ct(weights={"type": "int"}), "weights of type='int'"),
        (_ct(input_activations={"num_bits": 4}), "num_bits=4"),
        (_ct(kv_cache_scheme={"num_bits": 8, "type": "float"}), "kv_cache_scheme"),
        (_ct(weights={"strategy": "group", "group_size": 128}), "strategy='group'"),
        (_ct(format="pack-quantized"), "format='pack-quantized'"),
    ],
    ids=["gptq", "ue8m0", "static_blocks", "ct_int8", "ct_a4", "ct_kv", "ct_group", "ct_packed"],
)
def test_refusals_name_the_method_and_what_is_refused(qc, words):
    with pytest.raises(UnsupportedQuantizationError, match=words.replace("(", r"\(")):
        parse_fp8(qc)
    method, why = unserved_quantization(_config(qc))
    assert method == qc["quant_method"] and words in why


def test_plain_config_and_served_fp8_have_no_reason():
    assert unserved_quantization(transformers.LlamaConfig()) is None
    assert unserved_quantization(_config({"quant_method": "fp8"})) is None


NAMES = ["model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj", "lm_head",
         "model.layers.11.mlp.gate_proj"]  # fmt: skip


@pytest.mark.parametrize("skip", [None, ["lm_head"], ["layers.1"], ["model.layers.1.*"],
                                  ["q_proj", "lm_head"], []])  # fmt: skip
def test_finegrained_modules_follow_transformers(skip):
    cfg = parse_fp8({"quant_method": "fp8", "modules_to_not_convert": skip})
    for name in NAMES:
        theirs = should_convert_module(name, skip if skip is not None else ["lm_head"])
        assert cfg.converts(name) == theirs, (skip, name)


def test_compressed_tensors_ignore_names_and_regexes():
    cfg = parse_fp8(compressed_tensors_config("channel", True, ["lm_head", "re:.*layers\\.1\\."]))
    assert [cfg.converts(n) for n in NAMES] == [True, False, False, True]


def test_a_fused_layer_is_all_or_none_fp8():
    cfg = parse_fp8({"quant_method": "fp8", "modules_to_not_convert": ["k_proj"]})
    qkv = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"]
    with pytest.raises(UnsupportedQuantizationError, match="partly FP8"):
        layer_quant(cfg, qkv)
    assert layer_quant(cfg, ["model.layers.0.mlp.up_proj"]) is cfg
    assert layer_quant(cfg, ["model.layers.0.self_attn.k_proj"]) is None
