"""Random LoRA adapters for the LoRA benchmarks (``evaluation/bench_lora_cpu.py``,
``evaluation/bench_lora_gpu.py``), written as PEFT's ``save_pretrained`` writes them, so that
stock PEFT (``PeftModel.from_pretrained`` / ``load_adapter``) and ``hf_paged.LoRARequest`` read
the same files; and the per-request adapter assignment."""

from __future__ import annotations

import json
import os
import random

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _shapes(hf_config) -> dict[str, tuple[int, int]]:
    """``{projection: (in, out)}`` of one decoder layer."""
    h, inter = hf_config.hidden_size, hf_config.intermediate_size
    d = getattr(hf_config, "head_dim", None) or h // hf_config.num_attention_heads
    q, kv = hf_config.num_attention_heads * d, hf_config.num_key_value_heads * d
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}  # fmt: skip


def save_random_adapter(path: str, hf_config, rank: int, seed: int, dtype=torch.float32,
                        targets=PROJECTIONS, std: float = 0.02) -> str:  # fmt: skip
    """A LoRA adapter of ``rank`` on ``targets`` of every layer, N(0, std) factors (B too, unlike
    PEFT's zero init, so the adapter changes the output), ``lora_alpha = 2 * rank``."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    shapes = _shapes(hf_config)
    for i in range(hf_config.num_hidden_layers):
        for t in targets:
            fin, fout = shapes[t]
            mod = "mlp" if t in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{i}.{mod}.{t}"
            tensors[f"{key}.lora_A.weight"] = (std * torch.randn(rank, fin, generator=g)).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (std * torch.randn(fout, rank, generator=g)).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
              "target_modules": list(targets), "lora_dropout": 0.0, "bias": "none",
              "base_model_name_or_path": None, "use_rslora": False, "use_dora": False,
              "fan_in_fan_out": False, "inference_mode": True}  # fmt: skip
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)
    return path


def assign(num_requests: int, names: list[str], seed: int = 0) -> list[str]:
    """Per request, one of ``names`` uniformly (``"__base__"`` among them: no adapter)."""
    rng = random.Random(seed)
    return [rng.choice(names) for _ in range(num_requests)]


def load_peft(model, dirs: dict[str, str]):
    """Stock PEFT over ``model`` with every adapter of ``dirs`` loaded (the first active)."""
    from peft import PeftModel

    names = list(dirs)
    peft_model = PeftModel.from_pretrained(model, dirs[names[0]], adapter_name=names[0])
    for n in names[1:]:
        peft_model.load_adapter(dirs[n], adapter_name=n)
    return peft_model.eval()
