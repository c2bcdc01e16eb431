"""``generate(backend="paged")`` with ``prompt_lookup_num_tokens`` or ``assistant_model`` runs on the
engine's speculative steps and returns what stock returns: at batch size 1 stock's assisted
output (== its plain greedy), also as ``return_dict_in_generate``; for left-padded batches
(which stock's assisted decoding refuses) stock's plain greedy of the batch, EOS and padding
included. An assistant may be an HF model (its own paged engine drafts) or a
``PagedModelForCausalLM``. What stays stock is a named fallback."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from transformers import TextStreamer

from hf_paged import AutoPagedModelForCausalLM, envs
from hf_paged.integration import dispatch
from hf_paged.integration.fallback import PagedFallbackWarning, reset_fallback_warnings
from hf_paged.testing import build_char_tokenizer, build_hf_model

ENGINE = dict(num_kv_blocks=128, kv_block_size=4, max_num_seqs=8, max_model_len=128)
COMMON = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(autouse=True)
def clean_dispatch(monkeypatch):
    """The dispatcher installed, no backend switch set, fallback warnings afresh."""
    dispatch.install()
    monkeypatch.delenv(dispatch.ENV_VAR, raising=False)
    envs.reset()
    dispatch.set_default_backend(None)
    reset_fallback_warnings()
    yield
    dispatch.set_default_backend(None)
    envs.reset()


def perturbed(seed: int, noise: float):
    model = build_hf_model("llama", seed)
    g = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(noise * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def models():
    target, assistant = build_hf_model("llama", 0), perturbed(0, 0.03)
    agen = assistant.generation_config
    agen.num_assistant_tokens = 5  # stock's default 20 is slow here
    agen.assistant_confidence_threshold = 0.0  # stock's default 0.4 imports scikit-learn (7 s)
    for m in (target, assistant):
        dispatch.configure(m, **ENGINE)
    yield target, assistant
    for m in (target, assistant):
        dispatch.release(m)


def repeating(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 256) for _ in range(4)]
        out.append((motif * 3)[: 6 + i])
    return out


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def paged(model, **kw):
    """A paged call that must not fall back; returns its output and the engine's stats."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", PagedFallbackWarning)
        out = model.generate(backend="paged", **kw)
    return out, dispatch.get_engine(model).stats


@pytest.mark.parametrize("assist", ["lookup", "assistant"])
def test_batch_of_one_is_stocks_assisted_output(models, assist):
    target, assistant = models
    ids = torch.tensor(repeating(1, seed=1))
    extra = {"prompt_lookup_num_tokens": 4} if assist == "lookup" else {
        "assistant_model": assistant}  # fmt: skip
    with torch.no_grad():
        stock = target.generate(ids, **COMMON, **extra)
        plain = target.generate(ids, **COMMON)
    before = dispatch.get_engine(target).stats["spec_num_draft_tokens"]
    out, stats = paged(target, input_ids=ids, **COMMON, **extra)
    assert torch.equal(out, stock) and torch.equal(out, plain)
    assert stats["spec_num_draft_tokens"] > before  # it ran speculative steps
    d, _ = paged(target, input_ids=ids, return_dict_in_generate=True, **COMMON, **extra)
    assert torch.equal(d.sequences, stock) and d.scores is None


@pytest.mark.parametrize("assist", ["lookup", "assistant"])
def test_a_left_padded_batch_is_stocks_plain_greedy(models, assist):
    """Stock's assisted decoding raises for more than one row; the engine serves the batch,
    each row keeping its own number of tokens, and returns stock's plain greedy of it (rows
    that reach EOS padded as stock pads them)."""
    target, assistant = models
    ids, mask = left_pad(repeating(8, seed=2))
    extra = {"prompt_lookup_num_tokens": 4} if assist == "lookup" else {
        "assistant_model": assistant}  # fmt: skip
    with pytest.raises(ValueError, match="batch_size = 1"):
        target.generate(ids, attention_mask=mask, **COMMON, **extra)
    with torch.no_grad():
        plain = target.generate(ids, attention_mask=mask, **COMMON)
    kept = dispatch.get_engine(target).stats["spec_num_accepted_tokens"]
    out, stats = paged(target, input_ids=ids, attention_mask=mask, **COMMON, **extra)
    assert torch.equal(out, plain)
    assert stats["spec_num_accepted_tokens"] > kept
    # an EOS the rows reach: the same rows stop, padded the same way
    eos = int(plain[0, ids.shape[1] + 5])
    with torch.no_grad():
        plain = target.generate(ids, attention_mask=mask, eos_token_id=eos, **COMMON)
    out, _ = paged(target, input_ids=ids, attention_mask=mask, eos_token_id=eos, **COMMON,
                   **extra)  # fmt: skip
    assert torch.equal(out, plain)


def test_sampling_with_an_assistant_is_seeded_by_torch(models):
    target, assistant = models
    ids, mask = left_pad(repeating(2, seed=3))
    kw = dict(input_ids=ids, attention_mask=mask, assistant_model=assistant, max_new_tokens=12, do_sample=True,
              top_k=20, temperature=0.9, pad_token_id=0)  # fmt: skip
    torch.manual_seed(5)
    a, _ = paged(target, **kw)
    torch.manual_seed(5)
    b, _ = paged(target, **kw)
    assert torch.equal(a, b) and a.shape == (2, ids.shape[1] + 12)


def test_a_paged_model_serves_lookup_and_a_paged_assistant(tmp_path):
    target, assistant = build_hf_model("llama", 0), perturbed(0, 0.03)
    target.save_pretrained(tmp_path / "t")
    assistant.save_pretrained(tmp_path / "a")
    ids = torch.tensor(repeating(1, seed=4))
    with torch.no_grad():
        plain = target.generate(ids, **COMMON)
    with AutoPagedModelForCausalLM.from_pretrained(str(tmp_path / "t"), **ENGINE) as pt, \
            AutoPagedModelForCausalLM.from_pretrained(str(tmp_path / "a"), **ENGINE) as pa:  # fmt: skip
        assert torch.equal(pt.generate(ids, prompt_lookup_num_tokens=3, **COMMON), plain)
        assert torch.equal(pt.generate(ids, assistant_model=pa, **COMMON), plain)
        assert torch.equal(pt.generate(ids, assistant_model=assistant, **COMMON), plain)
        assert pt.engine.stats["spec_num_accepted_tokens"] > 0
        with pytest.raises(NotImplementedError, match="assisted_self"):
            pt.generate(ids, assistant_model=pt, **COMMON)


def fallback_cases(target, assistant):
    ids = torch.tensor(repeating(1, seed=5))
    tok = build_char_tokenizer(256)
    base = dict(input_ids=ids, max_new_tokens=6, pad_token_id=0)
    return {
        "universal_assisted": dict(base, assistant_model=assistant, tokenizer=tok,
                                   assistant_tokenizer=tok),
        "assistant_early_exit": dict(base, assistant_early_exit=1),
        "assisted_self": dict(base, assistant_model=target),
        "assisted_observed": dict(base, prompt_lookup_num_tokens=3, streamer=TextStreamer(tok)),
        "assisted_stop_strings": dict(base, prompt_lookup_num_tokens=3, stop_strings=["ab"],
                                      tokenizer=tok),
    }  # fmt: skip


@pytest.mark.parametrize(
    "reason",
    ["universal_assisted", "assistant_early_exit", "assisted_self", "assisted_observed",
     "assisted_stop_strings"],
)  # fmt: skip
def test_what_stays_stock_is_named(models, reason, capsys):
    target, assistant = models
    kw = fallback_cases(target, assistant)[reason]
    with pytest.warns(PagedFallbackWarning, match=f"\\[{reason}\\]"):
        try:
            got = target.generate(backend="paged", **kw)
        except ValueError as e:  # stock itself refuses this combination
            got = e
    try:
        with torch.no_grad():
            want = target.generate(**kw)
    except ValueError as e:
        want = e
    if isinstance(want, Exception):
        assert str(got) == str(want)
    else:
        assert torch.equal(got, want)


def test_stock_validation_errors_are_stocks(models):
    target, assistant = models
    ids = torch.tensor(repeating(1, seed=6))
    for kw in ({"prompt_lookup_num_tokens": 3}, {"assistant_model": assistant}):
        with pytest.raises(ValueError, match="num_return_sequences has to be 1"):
            target.generate(ids, backend="paged", num_return_sequences=2, do_sample=True, **kw)
