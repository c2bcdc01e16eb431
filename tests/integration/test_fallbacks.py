"""Every reason a paged call runs stock ``generate``: the result is stock's, with exactly one
``PagedFallbackWarning`` naming the reason per process (a second call warns no more), and no
engine work (none built, or for the reasons that need the engine, no request queued)."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import (
    LogitsProcessor,
    T5Config,
    T5ForConditionalGeneration,
)

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing import build_hf_model, fallback_warnings, left_pad, make_prompts, right_pad
from tests.integration.fake_engine import FakeEngine
from tests.integration.recorders import RecordingProcessor, RecordingStreamer

IDS = torch.tensor([[5, 6, 7, 8]])


@pytest.fixture(scope="module")
def llama():
    model = build_hf_model("llama", seed=0)
    yield model
    dispatch.release(model)


@pytest.fixture
def engines(monkeypatch, llama):
    """FakeEngines the dispatcher builds during the test."""
    built = []

    def factory(model, config):
        built.append(FakeEngine(model, config))
        return built[-1]

    monkeypatch.setattr(dispatch, "engine_factory", factory)
    dispatch.release(llama)
    yield built
    dispatch.release(llama)


def _sequences(out):
    return out.sequences if hasattr(out, "sequences") else out


def _paged(model, kwargs):
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = model.generate(**kwargs, backend="paged")
    return out, fallback_warnings(records)


def check_fallback(model, reason: str, make_kwargs):
    """Stock's result and one warning naming ``reason``; a second call: same, no warning."""
    torch.manual_seed(0)
    stock = _sequences(model.generate(**make_kwargs()))
    for attempt in range(2):
        torch.manual_seed(0)
        out, msgs = _paged(model, make_kwargs())
        assert torch.equal(_sequences(out), stock)
        if attempt == 0:
            assert len(msgs) == 1 and f"[{reason}]" in msgs[0], msgs
        else:
            assert msgs == []


def _custom_generate(model, input_ids, logits_processor, stopping_criteria, generation_config,
                     **kwargs):  # fmt: skip
    return torch.cat([input_ids, input_ids[:, :1]], dim=1)


def _call_cases(llama):
    """reason -> (reason key, kwargs factory); fresh objects per call (caches are mutated)."""
    ids, mask = left_pad(make_prompts([2, 5], seed=4))
    rids, rmask = right_pad(make_prompts([2, 5], seed=4))
    emb = llama.get_input_embeddings()(IDS).detach()
    base = dict(max_new_tokens=4)
    return {
        "assistant_model_self": (
            "assisted_self",
            lambda: dict(base, input_ids=IDS, assistant_model=llama),
        ),
        "prompt_lookup_streamer": (
            "assisted_observed",
            lambda: dict(
                base, input_ids=IDS, prompt_lookup_num_tokens=2, streamer=RecordingStreamer()
            ),
        ),
        "custom_generate": (
            "custom_generate",
            lambda: dict(base, input_ids=IDS, custom_generate=_custom_generate),
        ),
        "output_attentions": (
            "output_attentions",
            lambda: dict(base, input_ids=IDS, output_attentions=True, return_dict_in_generate=True),
        ),
        "output_hidden_states": (
            "output_hidden_states",
            lambda: dict(
                base, input_ids=IDS, output_hidden_states=True, return_dict_in_generate=True
            ),
        ),
        "inputs_embeds_beams": (
            "inputs_embeds",
            lambda: dict(base, inputs_embeds=emb, num_beams=2),
        ),
        "guidance_scale": ("guidance_scale", lambda: dict(base, input_ids=IDS, guidance_scale=1.5)),
        "position_ids": (
            "model_kwargs",
            lambda: dict(base, input_ids=IDS, position_ids=torch.arange(4)[None]),
        ),
        "right_padding": (
            "right_padding",
            lambda: dict(base, input_ids=rids, attention_mask=rmask),
        ),
        "empty_prompt": (
            "empty_prompt",
            lambda: dict(base, input_ids=ids, attention_mask=mask * torch.tensor([[0], [1]])),
        ),
        "mask_values": (  # stock's positions follow the running sum: 0, 2, 4 ...
            "attention_mask",
            lambda: dict(base, input_ids=ids, attention_mask=mask * 2),
        ),
    }


CALL_CASES = sorted(_call_cases(build_hf_model("llama")))


@pytest.mark.filterwarnings("ignore::FutureWarning")  # stock on past_key_values
@pytest.mark.parametrize("case", CALL_CASES)
def test_call_fallback(llama, engines, case):
    reason, make_kwargs = _call_cases(llama)[case]
    check_fallback(llama, reason, make_kwargs)
    assert engines == []  # judged before any engine is built


def test_max_model_len_fallback(llama, engines):
    def make_kwargs():
        return dict(input_ids=IDS, max_new_tokens=10, paged_config={"max_model_len": 8})

    torch.manual_seed(0)
    stock = llama.generate(input_ids=IDS, max_new_tokens=10)
    out, msgs = _paged(llama, make_kwargs())
    assert torch.equal(out, stock) and len(msgs) == 1 and "[max_model_len]" in msgs[0]
    assert _paged(llama, make_kwargs())[1] == []
    assert engines and all(e.num_added == 0 for e in engines)


def test_rope_length_fallback(engines):
    """longrope switches factors with the batch's longest row past original_max_position_embeddings
    (16): a call whose rows may pass it runs stock (the engine's batches and chunks differ)."""
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0] * 8, "long_factor": [4.0] * 8}  # fmt: skip
    model = build_hf_model("llama", seed=0, rope_parameters=rope, max_position_embeddings=64)
    check_fallback(model, "rope_length", lambda: dict(input_ids=IDS, max_new_tokens=13))
    assert all(e.num_added == 0 for e in engines)
    out, msgs = _paged(model, dict(input_ids=IDS, max_new_tokens=12))  # 16 tokens: served
    assert msgs == [] and engines[-1].num_added == 1
    dispatch.release(model)


def test_kv_cache_too_small_for_external_batch(llama, engines):
    ids, mask = left_pad(make_prompts([6, 6, 6], seed=8))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    stock = llama.generate(**kw, logits_processor=[RecordingProcessor()])
    cfg = {"num_kv_blocks": 4, "kv_block_size": 4}
    out, msgs = _paged(llama, dict(kw, logits_processor=[RecordingProcessor()], paged_config=cfg))
    assert torch.equal(out, stock) and len(msgs) == 1 and "[kv_cache]" in msgs[0]
    assert all(e.num_added == 0 for e in engines)


def test_reentrant_call_runs_stock(llama, engines):
    inner = []

    class Reenter(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not inner:
                inner.append(llama.generate(input_ids=IDS, max_new_tokens=2, backend="paged"))
            return scores

    ids, mask = left_pad(make_prompts([2, 5], seed=4))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    stock = llama.generate(**kw)
    out, msgs = _paged(llama, dict(kw, logits_processor=[Reenter()]))
    assert torch.equal(out, stock)
    assert len(msgs) == 1 and "[reentrant]" in msgs[0]
    assert torch.equal(inner[0], llama.generate(input_ids=IDS, max_new_tokens=2))


# ---- models the engine can't take ----------------------------------------------------------


def _t5():
    cfg = T5Config(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
                   decoder_start_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg).eval()


def _unserved_architecture():
    # AXK2's indexed (sparse) attention layers: neither model path serves them
    from hf_paged.testing import build_tiny

    return build_tiny("axk2")[1].eval()


def _fp16_llama():
    return build_hf_model("llama", seed=0).half()


def _training_llama():
    return build_hf_model("llama", seed=0, attention_dropout=0.1).train()


def _steered_llama():
    """A steering vector added to layer 0's output by a forward hook: stock runs it."""
    model = build_hf_model("llama", seed=0)
    shift = torch.full((model.config.hidden_size,), 3.0)
    model.model.layers[0].register_forward_hook(lambda mod, args, out: out + shift)
    return model


def _patched_llama():
    """An MLP's forward replaced on the instance (halved output): stock calls it."""
    model = build_hf_model("llama", seed=0)
    mlp = model.model.layers[1].mlp
    forward = mlp.forward
    mlp.forward = lambda x: forward(x) * 0.5
    return model


class _FlippedHead(torch.nn.Linear):
    """The caller's own head class: the same weight, its own forward (the vocabulary reversed)."""

    def forward(self, x):
        return super().forward(x).flip(-1)


def _custom_head_llama():
    """The output head swapped for a subclass of the caller's (same weights): stock calls its
    forward, which changes the tokens; the engine would read the weight alone."""
    model = build_hf_model("llama", seed=0)
    old = model.lm_head
    head = _FlippedHead(old.in_features, old.out_features, bias=False)
    head.weight = old.weight
    model.lm_head = head
    return model


MODEL_CASES = {
    "custom_modules": _custom_head_llama,
    "encoder_decoder": _t5,
    "architecture": _unserved_architecture,
    "dtype": _fp16_llama,
    "training_mode": _training_llama,
    "module_hooks": _steered_llama,
    "patched_forward": _patched_llama,
}


@pytest.mark.parametrize("reason", sorted(MODEL_CASES))
def test_model_fallback(engines, reason):
    model = MODEL_CASES[reason]()
    kwargs = dict(input_ids=IDS, max_new_tokens=3, pad_token_id=0)
    if reason == "training_mode":
        # dropout makes stock random: compare under the same seed
        check_fallback(model, reason, lambda: dict(kwargs, do_sample=False))
    else:
        check_fallback(model, reason, lambda: kwargs)
    assert engines == []
    assert existing_owner(model) is None


def test_custom_module_check_spares_an_architecture_of_the_callers_own():
    """A model class of the caller's (registered with the Auto classes, say) is its own
    definition: its modules are not surgery on a stock architecture (whether the engine builds
    that class is the architecture check's judgement); a stock class with a swapped head is."""
    from hf_paged.models.servable import hook_refusal

    stock = build_hf_model("llama", seed=0)

    class MyLlama(type(stock)):
        pass

    class MyNorm(type(stock.model.norm)):
        pass

    mine = MyLlama(stock.config)
    mine.model.norm = MyNorm(stock.config.hidden_size)
    assert hook_refusal(mine) is None
    assert hook_refusal(_custom_head_llama()).reason == "custom_modules"
    assert hook_refusal(stock) is None


def test_transformers_own_hooks_stay_paged(engines):
    """transformers installs output-capturing hooks when asked for hidden states once: they
    are not the caller's."""
    model = build_hf_model("llama", seed=0)
    model.generate(input_ids=IDS, max_new_tokens=2, output_hidden_states=True,
                   return_dict_in_generate=True)  # fmt: skip
    assert any(m._forward_hooks for m in model.modules())
    out, msgs = _paged(model, dict(input_ids=IDS, max_new_tokens=2))
    assert msgs == [] and len(engines) == 1
    assert torch.equal(out, model.generate(input_ids=IDS, max_new_tokens=2))
    dispatch.release(model)


def test_one_warning_per_reason_per_process(llama, engines):
    rids, rmask = right_pad(make_prompts([2, 5], seed=4))
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for _ in range(3):
            llama.generate(input_ids=rids, attention_mask=rmask, max_new_tokens=2, backend="paged")
            llama.generate(
                input_ids=IDS, max_new_tokens=2, output_hidden_states=True,
                return_dict_in_generate=True, backend="paged",
            )  # fmt: skip
    msgs = fallback_warnings(records)
    assert len(msgs) == 2
    assert any("[right_padding]" in m for m in msgs)
    assert any("[output_hidden_states]" in m for m in msgs)
