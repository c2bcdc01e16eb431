"""FP8 scales under tensor parallelism (tp=2 over gloo, CPU): block scales split with their
weight blocks, row scales with their rows, on both model paths; the tokens equal tp=1's. A
split that would cut a scale block is refused by name (unit level, no processes)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, SamplingParams
from hf_paged.distributed.communicator import Communicator
from hf_paged.layers.linear import QKVParallelLinear, RowParallelLinear
from hf_paged.layers.quantization.fp8_checkpoints import (
    load_finegrained_fp8,
    save_compressed_tensors_fp8,
)
from hf_paged.layers.quantization.fp8_config import parse_fp8
from hf_paged.testing import save_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
ENGINE = dict(max_model_len=64, kv_block_size=8, num_kv_blocks=40, max_num_seqs=4)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(3, 256) for _ in range(9)]
    return [[7]] + [shared + [rng.randrange(3, 256) for _ in range(rng.randint(1, 9))]
                    for _ in range(5)]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{"finegrained": 16x16 blocks (whole blocks on each of 2 ranks), "ct": per channel,
    "tensor": transformers' per-tensor format ([1, 1] weight scales, static activations)}."""
    root = tmp_path_factory.mktemp("fp8tp")
    plain = save_tiny_model("llama", str(root / "plain"), seed=5)
    fine = str(root / "fine")
    load_finegrained_fp8(plain, (16, 16), dtype=torch.float32).save_pretrained(fine)
    ct = str(root / "ct")
    base = AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32)
    save_compressed_tensors_fp8(base, ct, "channel", True)
    tensor = str(root / "tensor")
    model = load_finegrained_fp8(plain, None, dtype=torch.float32, activation_scheme="static")
    with torch.no_grad():  # transformers' quantizer leaves them unset
        for name, p in model.named_parameters():
            if name.endswith("activation_scale"):
                p.fill_(0.05)
    model.save_pretrained(tensor)
    return {"finegrained": fine, "ct": ct, "tensor": tensor}


@pytest.mark.parametrize(  # the generic path's channel scales: test_fp8_checkpoints at tp 1
    "fmt,model_impl",
    [
        ("finegrained", "native"),
        ("finegrained", "generic"),
        ("ct", "native"),
        ("tensor", "generic"),
    ],  # fmt: skip
)
def test_tp2_matches_tp1(checkpoints, fmt, model_impl):
    path, ps = checkpoints[fmt], prompts()
    with LLM(path, model_impl=model_impl, **ENGINE) as llm:
        ref = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
    with LLM(path, model_impl=model_impl, tensor_parallel_size=2, **ENGINE) as llm:
        got = [o.token_ids for o in llm.generate(ps, PARAMS, use_tqdm=False)]
        rank0 = llm.engine.executor.runner.model
    assert got == ref
    # rank 0 really holds half: its k projection's rows and their scales
    if model_impl == "native":
        qkv = rank0.model.layers[0].self_attn.qkv_proj
        assert qkv.weight.dtype == torch.float8_e4m3fn and qkv.weight.shape[0] == (64 + 64) // 2
        scale = qkv.weight_scale_inv if fmt == "finegrained" else qkv.weight_scale
        assert scale.shape[0] == (qkv.weight.shape[0] // 16 if fmt == "finegrained" else 64)
    else:
        k = rank0.hf_model.get_submodule("model.layers.0.self_attn.k_proj")
        assert k.weight.shape == (16, 64)
        if fmt == "finegrained":
            assert k.weight_scale_inv.shape == (1, 4)
        if fmt == "tensor":  # one scale for the whole weight, on every rank
            assert k.weight_scale_inv.shape == (1, 1)


class _TwoRanks(Communicator):
    """Rank 0 of 2 without a process group (construction only)."""

    def __init__(self):
        self.rank, self.world_size, self.group = 0, 2, None


def test_a_split_that_cuts_a_scale_block_is_refused_by_name():
    cfg = parse_fp8({"quant_method": "fp8", "weight_block_size": [32, 32]})
    comm = _TwoRanks()
    with pytest.raises(ValueError, match=r"shard 'k': 16 rows per rank .* weight_block_size\[0\]"):
        QKVParallelLinear(64, 16, 4, 2, bias=False, comm=comm, quant=cfg)
    with pytest.raises(ValueError, match=r"48 input columns per rank .*weight_block_size\[1\]"):
        RowParallelLinear(96, 64, bias=False, comm=comm, quant=cfg)
    QKVParallelLinear(64, 16, 4, 2, bias=False, quant=cfg)  # tp 1: the tensors stay whole
    RowParallelLinear(128, 64, bias=False, comm=comm, quant=cfg)  # 64 per rank: whole blocks


def test_generic_tp_plan_refuses_a_cut_block(tmp_path):
    from hf_paged.layers.quantization.fp8_config import fp8_config_of
    from hf_paged.models.generic.fp8 import install_fp8_linears
    from hf_paged.models.generic.support import UnsupportedModelError
    from hf_paged.models.generic.tp import apply_tp_plan

    plain = save_tiny_model("llama", str(tmp_path / "p"), seed=1)
    fp8 = load_finegrained_fp8(plain, (32, 32), dtype=torch.float32)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(fp8.config)
    install_fp8_linears(model, fp8_config_of(fp8.config))
    with pytest.raises(
        UnsupportedModelError, match=r"k_proj.weight_scale_inv has 16 rows per rank"
    ):
        apply_tp_plan(model, _TwoRanks())
