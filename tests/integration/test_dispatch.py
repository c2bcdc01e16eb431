"""The dispatcher: inert without a switch, the three switches, install/uninstall, one engine
per model (reuse, rebuild, release with the model), bad input, and the GenerationConfig ->
SamplingParams mapping (native vs external path)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import GenerationConfig, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.utils import GenerationMixin

from hf_paged.config import EngineConfig
from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.integration.plan import NativePlan, native_plan
from hf_paged.integration.prepare import prepare_call
from hf_paged.refusal import Refusal
from hf_paged.testing import build_hf_model, left_pad, make_prompts
from tests.integration.fake_engine import FakeEngine


@pytest.fixture
def llama():
    model = build_hf_model("llama", seed=0)
    yield model
    dispatch.release(model)


@pytest.fixture
def factory_calls(monkeypatch):
    """Every engine the dispatcher builds, as (model id, config); engines are FakeEngines."""
    calls = []

    def factory(model, config):
        calls.append((id(model), config))
        return FakeEngine(model, config)

    monkeypatch.setattr(dispatch, "engine_factory", factory)
    return calls


def _inputs():
    ids, mask = left_pad(make_prompts([2, 6], seed=1))
    return dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)


# ---- inert unless asked ------------------------------------------------------------------


def test_no_switch_is_stock_and_builds_nothing(llama, factory_calls):
    kw = _inputs()
    dispatch.uninstall()
    try:
        stock = llama.generate(**kw)
    finally:
        dispatch.install()
    assert dispatch.is_installed()
    out = llama.generate(**kw)
    assert torch.equal(out, stock)
    assert factory_calls == []
    assert existing_owner(llama) is None


def test_backend_hf_keyword_is_stock(llama, factory_calls):
    dispatch.set_default_backend("paged")
    out = llama.generate(**_inputs(), backend="hf")
    assert factory_calls == [] and out.shape == (2, 10)


def test_backend_keyword_switches(llama, factory_calls):
    llama.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 1


def test_process_default_switches(llama, factory_calls):
    dispatch.set_default_backend("paged")
    llama.generate(**_inputs())
    assert len(factory_calls) == 1
    assert dispatch.get_default_backend() == "paged"


def test_env_switch_and_explicit_default_wins(llama, factory_calls, monkeypatch):
    monkeypatch.setenv(dispatch.ENV_VAR, "paged")
    assert dispatch.get_default_backend() == "paged"
    llama.generate(**_inputs())
    assert len(factory_calls) == 1
    dispatch.set_default_backend("hf")
    dispatch.release(llama)
    llama.generate(**_inputs())
    assert len(factory_calls) == 1


def test_install_is_idempotent_and_uninstall_restores_original():
    dispatch.install()
    wrapper = GenerationMixin.__dict__["generate"]
    original = wrapper.__hf_paged_original__
    dispatch.install()
    assert GenerationMixin.__dict__["generate"] is wrapper
    dispatch.uninstall()
    try:
        assert GenerationMixin.__dict__["generate"] is original
        assert not dispatch.is_installed()
        dispatch.uninstall()  # twice is fine
        assert GenerationMixin.__dict__["generate"] is original
    finally:
        dispatch.install()


def test_generate_does_not_clash_with_transformers_keywords():
    import inspect

    params = inspect.signature(dispatch._original_generate).parameters
    assert "backend" not in params and "paged_config" not in params
    assert not hasattr(GenerationConfig(), "backend")
    assert not hasattr(GenerationConfig(), "paged_config")


# ---- bad input -----------------------------------------------------------------------------


def test_bad_backend_and_env_raise(llama, monkeypatch):
    with pytest.raises(ValueError, match="backend='fast'"):
        llama.generate(**_inputs(), backend="fast")
    with pytest.raises(ValueError, match="backend"):
        dispatch.set_default_backend("gpu")
    monkeypatch.setenv(dispatch.ENV_VAR, "pagd")
    with pytest.raises(ValueError, match=dispatch.ENV_VAR):
        llama.generate(**_inputs())


def test_bad_paged_config_raises_naming_the_key(llama, factory_calls):
    with pytest.raises(TypeError, match="bogus"):
        llama.generate(**_inputs(), backend="paged", paged_config={"bogus": 1})
    with pytest.raises(ValueError, match="max_num_seqs"):
        llama.generate(**_inputs(), backend="paged", paged_config={"max_num_seqs": 0})
    with pytest.raises(TypeError, match="paged_config"):
        llama.generate(**_inputs(), backend="paged", paged_config=[1])
    with pytest.raises(TypeError, match="bogus"):
        dispatch.configure(llama, bogus=1)
    assert factory_calls == []
    # the engine (none yet) and the model stay usable
    llama.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 1


def test_bad_prompt_raises_and_engine_stays_usable(llama, factory_calls):
    ids = torch.tensor([[5, 300]])  # 300 >= vocab
    with pytest.raises((ValueError, IndexError)):
        llama.generate(input_ids=ids, max_new_tokens=2, backend="paged")
    engine = dispatch.get_engine(llama)
    assert not engine.has_unfinished_requests()
    llama.generate(**_inputs(), backend="paged")


# ---- one engine per model ------------------------------------------------------------------


def test_engine_reused_and_rebuilt_on_config_change(llama, factory_calls):
    llama.generate(**_inputs(), backend="paged")
    first = dispatch.get_engine(llama)
    llama.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 1
    llama.generate(**_inputs(), backend="paged", paged_config={"max_num_seqs": 4})
    assert len(factory_calls) == 2 and first.closed
    assert factory_calls[-1][1] == EngineConfig(max_num_seqs=4)
    llama.generate(**_inputs(), backend="paged")  # no config: the engine there is fine
    assert len(factory_calls) == 2
    dispatch.configure(llama, max_num_seqs=2)
    llama.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 3 and factory_calls[-1][1] == EngineConfig(max_num_seqs=2)
    llama.generate(**_inputs(), backend="paged", paged_config=EngineConfig(max_num_seqs=2))
    assert len(factory_calls) == 3


def test_engine_per_model_and_rebuilt_when_weights_change(llama, factory_calls):
    other = build_hf_model("llama", seed=1)
    llama.generate(**_inputs(), backend="paged")
    other.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 2 and factory_calls[0][0] != factory_calls[1][0]
    with torch.no_grad():
        llama.lm_head.weight.mul_(1.5)  # in place: the engine's fused copies would be stale
    llama.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 3
    dispatch.release(other)


def test_engine_closed_with_the_model(monkeypatch):
    closed = []

    class Tiny:  # holds no reference to the model
        def close(self):
            closed.append(True)

    monkeypatch.setattr(dispatch, "engine_factory", lambda m, c: Tiny())
    model = build_hf_model("llama", seed=0)
    dispatch.get_engine(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None and closed == [True]


def test_real_engine_released_with_the_model():
    model = build_hf_model("llama", seed=0)
    dispatch.configure(model, num_kv_blocks=32, kv_block_size=4, max_num_batched_tokens=32)
    engine_ref = weakref.ref(dispatch.get_engine(model))
    model_ref = weakref.ref(model)
    del model
    gc.collect()
    assert model_ref() is None
    assert engine_ref() is None or engine_ref()._closed


def test_deepcopy_starts_without_engine(llama, factory_calls):
    import copy

    llama.generate(**_inputs(), backend="paged")
    clone = copy.deepcopy(llama)
    clone.generate(**_inputs(), backend="paged")
    assert len(factory_calls) == 2 and dispatch.get_engine(clone) is not dispatch.get_engine(llama)
    dispatch.release(clone)


# ---- GenerationConfig -> SamplingParams ------------------------------------------------------


def _plan(model, **kw):
    ids, mask = left_pad(make_prompts([3, 5], seed=2))
    call = prepare_call(model, input_ids=ids, attention_mask=mask, **kw)
    plan = native_plan(call, 256)
    assert isinstance(plan, Refusal) or not call.observed  # an observed call samples outside
    return call, None if isinstance(plan, Refusal) else plan


def test_mapping_greedy_defaults(llama):
    call, plan = _plan(llama, max_new_tokens=7)
    assert plan is not None
    p = plan.sampling_params()
    assert p.greedy and p.max_tokens == 7 and p.min_tokens == 0
    assert p.ignore_eos and p.stop_token_ids == (2,) and p.seed is None


def test_mapping_sampling_uses_hf_defaults(llama):
    # HF's default top_k=50 applies when sampling; temperature/top_p/min_p map one to one
    _, plan = _plan(llama, max_new_tokens=3, do_sample=True)
    p = plan.sampling_params(seed=5)
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 50, 1.0, 0.0, 5)
    _, plan = _plan(
        llama, max_new_tokens=3, do_sample=True, temperature=0.5, top_k=0, top_p=0.8,
        min_p=0.1, repetition_penalty=1.3, eos_token_id=[4, 9], min_new_tokens=2,
    )  # fmt: skip
    p = plan.sampling_params(seed=1)
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.5, -1, 0.8, 0.1)
    assert p.repetition_penalty == 1.3 and p.min_tokens == 2 and p.stop_token_ids == (4, 9)


def test_mapping_lengths(llama):
    call, plan = _plan(llama, max_length=9, min_length=8)  # padded width is 5
    assert plan.max_tokens == 4 and plan.min_tokens == 3
    _, plan = _plan(llama, max_new_tokens=4, eos_token_id=None)
    assert plan.sampling_params().stop_token_ids == ()


@pytest.mark.parametrize(
    "kw",
    [
        dict(no_repeat_ngram_size=2),
        dict(do_sample=True, typical_p=0.5),
        dict(bad_words_ids=[[5]]),
        dict(suppress_tokens=[5]),
        dict(max_time=10.0),
        dict(return_dict_in_generate=True, output_scores=True),
        dict(logits_processor=LogitsProcessorList([lambda ids, s: s])),
        dict(stopping_criteria=StoppingCriteriaList([lambda ids, s: False])),
    ],
    ids=lambda kw: next(iter(kw)),
)
def test_mapping_goes_external(llama, kw):
    _, plan = _plan(llama, max_new_tokens=3, **kw)
    assert plan is None


def test_mapping_stop_strings(llama):
    """Stop strings run in the engine unless stock's window could see a left pad, or a
    min length applies (stock matches before it)."""
    from hf_paged.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    _, plan = _plan(llama, max_new_tokens=3, stop_strings=["ab", "c"], tokenizer=tok)
    assert plan.sampling_params().stop == ("ab", "c")
    # rows are 3 and 5 tokens wide: a 5-character stop string reaches into the 3-row's pads
    _, plan = _plan(llama, max_new_tokens=3, stop_strings=["abcde"], tokenizer=tok)
    assert plan is None
    _, plan = _plan(llama, max_new_tokens=3, min_new_tokens=2, stop_strings=["a"], tokenizer=tok)
    assert plan is None


def test_native_plan_from_processors_refuses_unknown_and_right_semantics():
    from transformers.generation.logits_process import (
        RepetitionPenaltyLogitsProcessor,
        TopKLogitsWarper,
    )
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    crit = [MaxLengthCriteria(10)]
    kw = dict(do_sample=True, input_length=4, vocab_size=256, left_padded=True)
    plan = NativePlan.from_processors([TopKLogitsWarper(5, min_tokens_to_keep=2)], crit, **kw)
    assert isinstance(plan, Refusal) and "min_tokens_to_keep" in plan.detail
    plan = NativePlan.from_processors([RepetitionPenaltyLogitsProcessor(1.2)], crit,
                                      **dict(kw, left_padded=False))  # fmt: skip
    assert isinstance(plan, Refusal) and "left padded" in plan.detail
    assert NativePlan.from_processors([TopKLogitsWarper(300)], crit, **kw).top_k == -1  # off
    plan = NativePlan.from_processors([], crit, **dict(kw, input_length=10))
    assert plan.max_tokens == 1  # like stock
    # several criteria of one kind: stock stops on any of them
    both = [MaxLengthCriteria(7), EosTokenCriteria(5), MaxLengthCriteria(9), EosTokenCriteria(6)]
    plan = NativePlan.from_processors([], both, **kw)
    assert plan.max_tokens == 3 and plan.stop_token_ids == (5, 6)
