"""Which engines get LoRA slots (``models/adapters.lora_spec``): ``enable_lora`` on one rank;
refused by name with tensor parallelism; an in-memory PEFT model of plain LoRA automatically
(slot rank covering its adapters), one with merged adapters or ``modules_to_save`` not (its
adapters are merged, as before); the adapter key changes with the weights."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from hf_paged import EngineConfig  # noqa: E402
from hf_paged.models.adapters import LoraAdapter, LoraFactors, lora_spec  # noqa: E402
from hf_paged.testing import build_hf_model  # noqa: E402


def test_enable_lora_on_one_rank_and_refused_with_tp():
    spec = lora_spec("/some/ckpt", EngineConfig(enable_lora=True, max_loras=3, max_lora_rank=8))
    assert (spec.max_loras, spec.max_rank, spec.max_cpu_loras, spec.from_peft) == (3, 8, 16, False)
    assert lora_spec("/some/ckpt", EngineConfig()) is None
    with pytest.raises(
        ValueError, match="enable_lora=True is not allowed with tensor_parallel_size=2"
    ):
        lora_spec("/some/ckpt", EngineConfig(enable_lora=True, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="max_cpu_loras=2 is not allowed"):
        EngineConfig(max_loras=4, max_cpu_loras=2)


def test_peft_models_get_slots_unless_merged():
    model = get_peft_model(build_hf_model("llama"), LoraConfig(r=32, target_modules=["q_proj"]))
    spec = lora_spec(model, EngineConfig())
    assert spec.from_peft and spec.max_rank == 32 and spec.dtype == "float32"
    assert lora_spec(model, EngineConfig(tensor_parallel_size=2)) is None  # merged, as before
    model.merge_adapter()
    assert lora_spec(model, EngineConfig()) is None
    saved = get_peft_model(
        build_hf_model("llama"),
        LoraConfig(r=4, target_modules=["v_proj"], modules_to_save=["lm_head"]),
    )
    assert lora_spec(saved, EngineConfig()) is None


def test_key_is_name_plus_weight_digest():
    a, b = torch.ones(2, 8), torch.ones(4, 2)
    one = LoraAdapter("x", {"model.layers.0.self_attn.q_proj": LoraFactors(a, b, 2.0)})
    same = LoraAdapter("x", {"model.layers.0.self_attn.q_proj": LoraFactors(a.clone(), b, 2.0)})
    other = LoraAdapter("x", {"model.layers.0.self_attn.q_proj": LoraFactors(a, 2 * b, 2.0)})
    scaled = LoraAdapter("x", {"model.layers.0.self_attn.q_proj": LoraFactors(a, b, 1.0)})
    assert one.key == same.key and one.key.startswith("x@")
    assert len({one.key, other.key, scaled.key}) == 3
