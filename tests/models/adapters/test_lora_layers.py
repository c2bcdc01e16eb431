"""A wrapped layer's delta for a step whose tokens all use one adapter is PEFT's
``result + lora_B(lora_A(x)) * scaling``, in that order (CPU fp32): an unfused layer bit for bit;
a fused q/k/v layer (one shrink for every slice, then one block-diagonal expand while its zero
blocks cost less than the per-slice ops, else one per slice) to the last bits only, as its base
GEMM already differs from HF's three projections (the BLAS picks its kernels by the matrices' widths). Adapters
of lower rank than the slots, a slice the adapter leaves alone, scalings folded into ``B`` (powers
of two: the same bits) or applied after it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.kernels.lora_segmented import LoraSegments
from hf_paged.models.adapters.adapter import LoraFactors
from hf_paged.models.adapters.layers import BLOCK_DIAG_WASTE_MAX, GATHER_MAX_TOKENS, attach_lora

SLOT_RANK = 16


class _FusedQKV(nn.Module):
    """A stand-in for the native ``qkv_proj``: one GEMM, three HF modules' columns."""

    def __init__(self, k: int, sizes: tuple[int, ...]):
        super().__init__()
        self.sizes, self.input_size, self.output_size = sizes, k, sum(sizes)
        self.weight = nn.Parameter(torch.randn(sum(sizes), k) / k**0.5, requires_grad=False)

    def shard_ids(self):
        return ("q", "k", "v")

    def shard_slice(self, shard):
        i = self.shard_ids().index(shard)
        return SimpleNamespace(dst=sum(self.sizes[:i]), size=self.sizes[i])

    def forward(self, x):
        return F.linear(x, self.weight)


def _model(k: int, sizes: tuple[int, ...]) -> nn.Module:
    torch.manual_seed(0)
    attn = nn.Module()
    attn.qkv_proj = _FusedQKV(k, sizes)
    attn.o_proj = nn.Linear(sizes[0], k, bias=False)
    layer = nn.Module()
    layer.self_attn = attn
    model = nn.Module()
    model.layers = nn.ModuleList([layer])
    return model


def _factors(k, sizes, ranks, seed, scales=(2.0, 0.75, 1.3, 0.5)):
    """PEFT-shaped factors per HF module (rank 0: the module is left alone)."""
    g = torch.Generator().manual_seed(seed)
    names = ["q_proj", "k_proj", "v_proj"]
    fins = {n: k for n in names} | {"o_proj": sizes[0]}
    fouts = dict(zip(names, sizes)) | {"o_proj": k}
    out = {}
    for (name, r), scale in zip(ranks.items(), scales):
        if r:
            mod = f"layers.0.self_attn.{name}"
            out[mod] = LoraFactors(torch.randn(r, fins[name], generator=g),
                                   torch.randn(fouts[name], r, generator=g), scale)  # fmt: skip
    return out


def _peft(x, base, f: LoraFactors | None):
    """PEFT's ``lora.Linear.forward`` for one adapter: ``result + lora_B(lora_A(x)) * scaling``."""
    return base if f is None else base + F.linear(F.linear(x, f.a), f.b) * f.scale


# scalings: some powers of two (folded into B), some not; all powers of two (no scale op left)
@pytest.mark.parametrize("scales", [(2.0, 0.75, 1.3, 0.5), (2.0, 0.5, 4.0, 1.0)])
@pytest.mark.parametrize("tokens", [1, 16, GATHER_MAX_TOKENS + 3])
@pytest.mark.parametrize("sizes", [(64, 32, 32), (256, 128, 128), (2048, 1024, 1024)])
@torch.no_grad()
def test_one_adapter_step_is_peft_delta(tokens, sizes, scales):
    k = 64 if sizes[0] == 64 else 256
    model = _model(k, sizes)
    step, _, layers = attach_lora(model, "", max_loras=2, max_rank=SLOT_RANK,
                                  dtype=torch.float32, device="cpu")  # fmt: skip
    factors = _factors(k, sizes, {"q_proj": 8, "k_proj": 0, "v_proj": 3, "o_proj": 5}, seed=1,
                       scales=scales)  # fmt: skip
    other = _factors(k, sizes, {"q_proj": 16, "k_proj": 16, "v_proj": 16, "o_proj": 16}, seed=2)
    for layer in layers:
        layer.write(0, other)  # a second slot, to show slot 1's operands are its own
        layer.write(1, factors)
    qkv, o = model.layers[0].self_attn.qkv_proj, model.layers[0].self_attn.o_proj
    ops = qkv.lora.operands[1]
    assert ops.b_t is not None and (ops.scales is None) == (scales[2] == 4.0)
    one_expand = tokens * ops.waste <= BLOCK_DIAG_WASTE_MAX  # else per slice
    assert one_expand == (tokens == 1 or sizes[0] < 2048)  # both paths are tested
    x, x_o = torch.randn(tokens, k), torch.randn(tokens, sizes[0])
    step.segments, step.uniform_slot = LoraSegments.from_slots([], "cpu"), 1
    got_qkv, got_o = qkv(x), o(x_o)
    step.segments = step.uniform_slot = None
    base_qkv, base_o = qkv(x), o(x_o)
    want = []
    for name, part in zip(("q_proj", "k_proj", "v_proj"), base_qkv.split(list(sizes), dim=1)):
        want.append(_peft(x, part, factors.get(f"layers.0.self_attn.{name}")))
    assert not torch.equal(got_qkv, base_qkv)
    want = torch.cat(want, dim=1)
    assert (got_qkv - want).abs().max() <= 1e-6 * want.abs().max()
    assert torch.equal(
        got_qkv[:, sizes[0] : sizes[0] + sizes[1]], base_qkv[:, sizes[0] : -sizes[2]]
    )
    assert torch.equal(got_o, _peft(x_o, base_o, factors["layers.0.self_attn.o_proj"]))
