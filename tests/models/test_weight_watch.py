"""Weights changed between paged calls are what the next paged call computes with, whatever
changed them, and the engine follows them without being rebuilt.

Each test: a paged ``generate`` (the engine is built and holds its fused q/k/v and gate/up
copies), then a change to the model's weights (fused AdamW, fused SGD with momentum, foreach
Adam, ``load_state_dict``, ``copy_`` under ``no_grad``, a write through ``.data``, a PEFT
adapter trained in place, an FP8 model given new quantized weights), then greedy ``generate``
paged and stock on the same model: equal tokens and scores within 1e-4, served by the same
engine object with the same KV cache storage (no rebuild, no re-allocation). A change that
replaces a parameter rebuilds the engine, and is still right.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from hf_paged import PagedFallbackWarning
from hf_paged.integration import dispatch
from hf_paged.testing import SMALL_ENGINE, build_hf_model

IDS = torch.tensor([[0, 0, 5, 9, 17, 33, 8, 41, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11]])
MASK = (IDS != 0).long()
GREEDY = dict(max_new_tokens=10, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)  # fmt: skip

OPTIMIZERS = {
    "adamw_fused": lambda ps: torch.optim.AdamW(ps, lr=2e-2, fused=True),
    "sgd_momentum_fused": lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9, fused=True),
    "adam_foreach": lambda ps: torch.optim.Adam(ps, lr=2e-2, foreach=True),
}


def _generate(model, backend: str, **overrides):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)  # a fallback fails the test
        kwargs = {**GREEDY, **overrides}
        return model.generate(input_ids=IDS, attention_mask=MASK, **kwargs, backend=backend)


def _train(model, optimizer, steps: int = 2) -> None:
    """``steps`` optimizer steps of causal-LM loss on ``IDS``; the model is left in eval mode."""
    model.train()
    for _ in range(steps):
        model(input_ids=IDS, attention_mask=MASK, labels=IDS).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def _engine_state(model):
    engine = dispatch.get_engine(model)
    return engine, engine.executor.runner.kv_cache


def _assert_paged_is_stock(model, before=None) -> None:
    paged = _generate(model, "paged")
    stock = _generate(model, "hf")
    assert torch.equal(paged.sequences, stock.sequences)
    for p, s in zip(paged.scores, stock.scores, strict=True):
        torch.testing.assert_close(p, s, atol=1e-4, rtol=0)
    if before is not None:  # the same engine and KV cache served it
        engine, kv = _engine_state(model)
        assert engine is before[0] and kv is before[1]
        assert kv.nbytes() == before[1].nbytes()


@pytest.fixture(autouse=True)
def _dispatch(one_thread, clean_dispatch):
    """The dispatcher installed, switches and fallback warnings reset (tests/conftest.py)."""


def _first_paged_call(model):
    first = _generate(model, "paged")
    return first, _engine_state(model)


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_optimizer_steps_are_served_without_a_rebuild(small_llama, optimizer):
    first, before = _first_paged_call(small_llama)
    _train(small_llama, OPTIMIZERS[optimizer](small_llama.parameters()))
    _assert_paged_is_stock(small_llama, before)
    assert not torch.equal(first.sequences, _generate(small_llama, "hf").sequences)  # it mattered


def test_load_state_dict_is_served_without_a_rebuild(small_llama):
    first, before = _first_paged_call(small_llama)
    small_llama.load_state_dict(build_hf_model("llama", seed=5).state_dict())
    _assert_paged_is_stock(small_llama, before)
    assert not torch.equal(first.sequences, _generate(small_llama, "hf").sequences)


def test_copy_under_no_grad_and_writes_through_data_are_served(small_llama):
    """``copy_`` bumps the version counter; ``.data`` writes bump nothing (the probe sees them)."""
    _, before = _first_paged_call(small_llama)
    other = build_hf_model("llama", seed=6)
    mlp, attn = small_llama.model.layers[1].mlp, small_llama.model.layers[0].self_attn
    with torch.no_grad():
        mlp.up_proj.weight.copy_(other.model.layers[1].mlp.up_proj.weight)
    _assert_paged_is_stock(small_llama, before)
    attn.k_proj.weight.data.copy_(other.model.layers[0].self_attn.k_proj.weight)
    _assert_paged_is_stock(small_llama, before)


def test_a_replaced_parameter_rebuilds_the_engine(small_llama):
    _, before = _first_paged_call(small_llama)
    q = small_llama.model.layers[0].self_attn.q_proj
    q.weight = torch.nn.Parameter(q.weight.detach() * -1.0)  # new storage: the engine's is old
    _assert_paged_is_stock(small_llama)
    assert dispatch.get_engine(small_llama) is not before[0]


def test_refresh_drops_the_prefix_cache(small_llama):
    """Blocks cached under the old weights are not reused for the same prompt after a step.
    (A plain call: with ``return_dict_in_generate`` the returned cache is read back through the
    prefix cache, which counts hits of the call's own blocks.)"""
    plain = dict(return_dict_in_generate=False, output_scores=False)
    _generate(small_llama, "paged", **plain)
    _train(small_llama, OPTIMIZERS["adamw_fused"](small_llama.parameters()), steps=1)
    engine = dispatch.get_engine(small_llama)  # refreshed here
    engine.block_manager.reset_stats()
    _generate(small_llama, "paged", **plain)
    assert engine.block_manager.num_prefix_hit_tokens == 0
    _generate(small_llama, "paged", **plain)  # unchanged weights: the prefix cache serves it again
    assert engine.block_manager.num_prefix_hit_tokens > 0


def test_peft_adapter_trained_in_place_is_served():
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    model = peft.get_peft_model(build_hf_model("llama", seed=0), config)
    dispatch.configure(model, **SMALL_ENGINE)
    try:
        _, before = _first_paged_call(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n, p in model.named_parameters()
                                 if p.requires_grad)  # fmt: skip
        _train(model, torch.optim.AdamW(trainable, lr=5e-2, fused=True))
        _assert_paged_is_stock(model, before)
    finally:
        dispatch.release(model)


def test_fp8_model_given_new_quantized_weights_is_served(tmp_path):
    """An in-memory FP8 model (transformers' FineGrainedFP8) whose float8 weights and scales
    are replaced in place by another quantization, as an RL weight sync into an FP8 policy
    does: the engine's fused FP8 q/k/v and gate/up take the new weights and scales. Stock's FP8
    forward does not run on CPU: its oracle is transformers' dequantized model of the new
    weights (as in tests/models/test_fp8_checkpoints.py)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    from hf_paged.layers.quantization.fp8_checkpoints import load_finegrained_fp8
    from hf_paged.testing import save_tiny_model

    block = (32, 32)
    old, new = (save_tiny_model("llama", str(tmp_path / f"s{s}"), seed=s) for s in (3, 4))
    model = load_finegrained_fp8(old, block, dtype=torch.float32)
    update = load_finegrained_fp8(new, block, dtype=torch.float32)
    update.save_pretrained(str(tmp_path / "fp8_new"))
    oracle = AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "fp8_new"), quantization_config=FineGrainedFP8Config(dequantize=True),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    dispatch.configure(model, **SMALL_ENGINE)
    try:
        _, before = _first_paged_call(model)
        model.load_state_dict(update.state_dict())
        paged = _generate(model, "paged")
        with torch.no_grad():
            stock = oracle.generate(input_ids=IDS, attention_mask=MASK, **GREEDY)
        assert torch.equal(paged.sequences, stock.sequences)
        for p, s in zip(paged.scores, stock.scores, strict=True):
            torch.testing.assert_close(p, s, atol=1e-4, rtol=0)
        assert _engine_state(model)[0] is before[0]
    finally:
        dispatch.release(model)


def test_generic_model_path_follows_optimizer_steps():
    model = build_hf_model("qwen3", seed=0)
    dispatch.configure(model, **SMALL_ENGINE, model_impl="generic")
    try:
        _, before = _first_paged_call(model)
        _train(model, OPTIMIZERS["adamw_fused"](model.parameters()))
        _assert_paged_is_stock(model, before)
    finally:
        dispatch.release(model)


def test_watch_names_what_changed_and_nothing_else():
    """The watch alone: nothing changed -> nothing named; a fused step names the stepped
    parameters only (the hook); ``.data`` writes are named by the probe; a LoRA factor names
    the merged weight it feeds; a replaced parameter is a layout change."""
    from hf_paged.models import weight_stamp
    from hf_paged.models.weight_watch import WeightWatch

    model = build_hf_model("llama", seed=0)
    watch = WeightWatch(model)
    assert watch.changed() == set() and not watch.layout_changed(model)
    head = model.lm_head.weight
    head.grad = torch.ones_like(head)
    torch.optim.SGD([head], lr=0.1, fused=True).step()
    assert watch.changed() == {"lm_head.weight"}
    watch.synced()
    assert watch.changed() == set()
    model.model.norm.weight.data.mul_(2.0)  # no version bump, no optimizer
    assert watch.changed() == {"model.norm.weight"}
    model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight.detach().clone())
    assert watch.layout_changed(model)
    assert weight_stamp.hook_installed()
    live = weight_stamp.holders()
    del watch
    gc.collect()
    assert weight_stamp.holders() == live - 1
    assert weight_stamp.hook_installed() == (live > 1)  # removed with the last holder

    peft = pytest.importorskip("peft")
    lora = peft.get_peft_model(build_hf_model("llama", seed=0),
                               peft.LoraConfig(r=2, target_modules=["v_proj"]))  # fmt: skip
    watch = WeightWatch(lora)
    factor = lora.base_model.model.model.layers[1].self_attn.v_proj.lora_B["default"].weight
    with torch.no_grad():
        factor.add_(1.0)
    assert watch.changed() == {"model.layers.1.self_attn.v_proj.weight"}
