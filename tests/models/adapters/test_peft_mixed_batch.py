"""Many PEFT LoRA adapters on one engine, with stock PEFT as the oracle (CPU fp32, greedy): a
left-padded mixed batch over three adapters (different ranks and targets) and ``"__base__"``,
with and without beams; one prompt under each adapter and the base, one call each on one engine;
``set_adapter`` switches and several active adapters; an adapter added after the engine was
built, then used by name; in-place updates; stock's errors for what stock refuses. Every call
must be served (a fallback warning is an error) and the engine is never rebuilt.
"""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, get_peft_model  # noqa: E402

from hf_paged import PagedFallbackWarning  # noqa: E402
from hf_paged.integration import dispatch  # noqa: E402
from hf_paged.testing import PAD, SMALL_ENGINE, build_hf_model, left_pad, make_prompts  # noqa: E402
from hf_paged.testing.models import randomize_lora_  # noqa: E402

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets): different ranks and targets
ADAPTERS = {"sql": (4, 8, ATTN + MLP), "chat": (2, 4, ["q_proj", "v_proj", "down_proj"]),
            "code": (8, 16, MLP + ["k_proj"])}  # fmt: skip
LENGTHS = [1, 3, 4, 5, 9]  # 5 rows: 1 and both sides of the 4-token block boundaries
NAMES = ["sql", "__base__", "chat", "code", "sql"]
NEW = 10


def _model(names=("sql", "chat", "code"), family="llama"):
    base = build_hf_model(family, seed=0)
    model = None
    for i, n in enumerate(names):
        r, alpha, targets = ADAPTERS[n]
        cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets)
        if model is None:
            model = get_peft_model(base, cfg, adapter_name=n)
        else:
            model.add_adapter(n, cfg)
        randomize_lora_(model, seed=100 + i, adapter=n)
    model.eval()
    dispatch.configure(model, **SMALL_ENGINE)
    return model


def _inputs(lengths=LENGTHS, new=NEW, **kw) -> dict:
    ids, mask = left_pad(make_prompts(lengths))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                pad_token_id=PAD, **kw)  # fmt: skip


def _paged(model, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        return model.generate(**kwargs, backend="paged")


def _both(model, **kwargs):
    stock = model.generate(**kwargs)
    paged = _paged(model, **kwargs)
    assert torch.equal(paged, stock)
    return stock


@pytest.fixture(autouse=True)
def release_engines():
    yield
    import gc

    gc.collect()


@pytest.mark.parametrize("num_beams", [1, 2])
def test_mixed_batch_equals_stock_peft(num_beams, engines_built):
    model = _model()
    kw = _inputs(num_beams=num_beams)
    out = _both(model, adapter_names=NAMES, **kw)
    # each row is its own adapter's (or the base's) output
    with model.disable_adapter():
        base = model.generate(**kw)
    assert torch.equal(out[1], base[1]) and not torch.equal(out[0], base[0])
    assert len(engines_built) == 1 and engines_built[0].lora is not None


def test_same_prompt_under_each_adapter_one_engine(engines_built):
    model = _model()
    kw = _inputs(lengths=[6])
    outs = [_both(model, adapter_names=[n], **kw) for n in ("sql", "chat", "code", "__base__")]
    assert len({tuple(o[0].tolist()) for o in outs}) == 4  # every adapter changes the output
    assert len(engines_built) == 1


def test_set_adapter_switch_and_several_active(engines_built):
    model = _model()
    kw = _inputs()
    seen = []
    for name in ("chat", "code", "sql"):
        model.set_adapter(name)
        seen.append(_both(model, **kw))
    model.base_model.set_adapter(["sql", "code"])  # several active: their deltas add
    both = _both(model, **kw)
    assert all(not torch.equal(both, s) for s in seen)
    with model.disable_adapter():  # disable wins, adapter_names included
        plain = _both(model, **kw)
        assert torch.equal(_paged(model, adapter_names=NAMES, **kw), plain)
    assert len(engines_built) == 1


def test_adapter_added_after_build_then_used_by_name(engines_built):
    model = _model(names=("sql",))
    kw = _inputs()
    _both(model, adapter_names=["sql"] * len(LENGTHS), **kw)
    r, alpha, targets = ADAPTERS["chat"]
    model.add_adapter("late", LoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    randomize_lora_(model, seed=9, adapter="late")
    out = _both(model, adapter_names=["late", "sql", "__base__", "late", "sql"], **kw)
    with torch.no_grad():  # an in-place update of the late adapter: a new key, not stale KV
        model.base_model.model.model.layers[0].self_attn.q_proj.lora_B["late"].weight.mul_(-4)
    again = _both(model, adapter_names=["late", "sql", "__base__", "late", "sql"], **kw)
    assert not torch.equal(out[0], again[0])
    model.delete_adapter("late")
    with pytest.raises(ValueError, match="non-existing adapter"):
        model.generate(**kw, adapter_names=["late"] * len(LENGTHS), backend="paged")
    assert len(engines_built) == 1


def test_what_stock_refuses_is_refused_alike():
    model = _model()
    kw = _inputs(lengths=[3, 5])
    names = ["sql", "chat"]
    with pytest.raises(ValueError, match="non-existing adapter"):
        model.generate(**kw, adapter_names=["sql", "nope"], backend="paged")
    sampled = {**kw, "do_sample": True, "num_return_sequences": 2}
    for backend in ("paged", "hf"):  # the engine matches stock's refusal
        with pytest.raises(ValueError, match="Length of `adapter_names`"):
            model.generate(**sampled, adapter_names=names, backend=backend)
    model.train()
    with pytest.raises(ValueError, match="training mode"):
        model.generate(**kw, adapter_names=names, backend="paged")


@pytest.mark.gpu
@pytest.mark.parametrize("num_beams", [1, 2])
def test_mixed_batch_on_cuda_equals_stock_peft(num_beams, engines_built):
    """The same mixed batch on CUDA (fp32): the Triton shrink/expand serves the mixed steps."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model().cuda()
    kw = _inputs(num_beams=num_beams)
    kw = {k: v.cuda() if torch.is_tensor(v) else v for k, v in kw.items()}
    _both(model, adapter_names=NAMES, **kw)
    assert engines_built[0].lora is not None and engines_built[0].runtime.device.startswith("cuda")


def test_adapters_trained_in_place_by_a_fused_optimizer(engines_built):
    """A fused optimizer writes the factors without a version bump: the engine owner's weight
    watch sees it, the adapters get new digests (new keys, fresh slots), nothing is rebuilt;
    an adapter added later is followed too."""
    model = _model(names=("sql", "chat"))
    kw = _inputs()
    names = ["sql", "chat", "__base__", "sql", "chat"]
    first = _both(model, adapter_names=names, **kw)
    r, alpha, targets = ADAPTERS["code"]
    model.add_adapter("code", LoraConfig(r=r, lora_alpha=alpha, target_modules=targets))
    randomize_lora_(model, seed=5, adapter="code")
    late = ["code", "sql", "__base__", "code", "chat"]
    _both(model, adapter_names=late, **kw)
    for step_on in (["sql"], ["code"]):
        params = [p for n, p in model.named_parameters()
                  if "lora_" in n and any(f".{a}." in n for a in step_on)]  # fmt: skip
        opt = torch.optim.AdamW(params, lr=0.05, fused=True)
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        again = _both(model, adapter_names=late, **kw)
    assert not torch.equal(again, first) and len(engines_built) == 1
