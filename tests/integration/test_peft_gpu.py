"""PEFT LoRA on one GPU (Triton backend, decode CUDA graphs): fp32 greedy equals stock PEFT,
also after an in-place lora_B update between calls (the rebuilt engine's graphs see the new
merged weights), and a bf16 base with fp32 adapter weights (PEFT's default autocast) is served,
not refused for mixed dtypes."""

from __future__ import annotations

import warnings

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
peft = pytest.importorskip("peft")

from hf_paged import PagedFallbackWarning  # noqa: E402
from hf_paged.testing import build_hf_model  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ENGINE = dict(num_kv_blocks=256, kv_block_size=16, max_num_seqs=16)
NEW = 24


def _lora(family: str, dtype=torch.float32):
    base = build_hf_model(family, seed=0).to("cuda", dtype)
    cfg = peft.LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS)
    model = peft.get_peft_model(base, cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model.eval()


def _inputs():
    lengths = [1, 15, 16, 17, 33, 40]
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device="cuda")
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device="cuda")
    return dict(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )


def _paged(model):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        return model.generate(**_inputs(), backend="paged", paged_config=ENGINE)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_lora_fp32_equals_stock_peft_with_graphs(family):
    model = _lora(family)
    assert torch.equal(_paged(model), model.generate(**_inputs()))
    with torch.no_grad():
        model.base_model.model.model.layers[1].mlp.down_proj.lora_B["default"].weight.mul_(-2)
    assert torch.equal(_paged(model), model.generate(**_inputs()))


def test_bf16_base_with_fp32_adapters_is_served():
    model = _lora("llama", dtype=torch.bfloat16)
    dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    assert dtypes == {torch.float32}  # PEFT upcasts adapter weights by default
    out = _paged(model)  # raises on a fallback warning
    stock = model.generate(**_inputs())
    assert out.shape == stock.shape
    # bf16 rounding differs between merged and unmerged LoRA; the first new token agrees
    width = _inputs()["input_ids"].shape[1]
    assert (out[:, width] == stock[:, width]).float().mean() >= 0.8
