"""Stock ``generate`` vs ``generate(backend="paged")`` on a tiny fp32 llama, run on the fake
engine (HF forwards, so only the integration is under test) and on the real engine.

Greedy calls must give identical ``sequences``; scores/logits must be allclose; user processors,
stopping criteria and streamers must see the same calls. Tokens that drive EOS, bad words etc.
are picked from a stock run so every semantic actually changes the output."""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing import (
    SMALL_ENGINE,
    build_hf_model,
    left_pad,
    make_prompts,
    right_pad,
    stock_and_paged,
    tiny_tokenizer,
)
from tests.integration.recorders import (
    RecordingCriteria,
    RecordingProcessor,
    RecordingStreamer,
)

NEW = 8
BATCH_LENGTHS = [1, 7, 4, 11]


@pytest.fixture(scope="module")
def batch():
    return left_pad(make_prompts(BATCH_LENGTHS, seed=0))


def reference(model, ids, mask, **kw):
    kw.setdefault("max_new_tokens", NEW)
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=False, **kw)


def eos_from(ref, width, picks):
    """Token ids at new-token positions ``picks`` [(row, step)] of a stock output."""
    return [int(ref[r, width + s]) for r, s in picks]


@pytest.mark.parametrize("lengths", [[5], [1], [3, 3], BATCH_LENGTHS], ids=str)
def test_greedy_left_padded(model, lengths):
    ids, mask = left_pad(make_prompts(lengths, seed=len(lengths)))
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False
    )
    assert paged.shape == stock.shape == (len(lengths), ids.shape[1] + NEW)
    assert torch.equal(paged, stock)


def test_greedy_positional_input_without_mask(model):
    ids = torch.tensor(make_prompts([6, 6], seed=3))
    stock = model.generate(ids, max_new_tokens=NEW)
    paged = model.generate(ids, max_new_tokens=NEW, backend="paged")
    assert torch.equal(paged, stock)


def test_no_input_starts_from_bos_and_return_dict_without_scores(model):
    stock, paged, *_ = stock_and_paged(model, max_new_tokens=NEW, return_dict_in_generate=True)
    assert type(paged) is type(stock)
    assert torch.equal(paged.sequences, stock.sequences) and paged.sequences[0, 0] == 1
    assert paged.scores is None and paged.logits is None
    # stock's cache comes back (contract/cache.py; transformers 5.17 names it past_key_values)
    assert type(paged.cache) is type(stock.cache)
    assert paged.cache.get_seq_length() == stock.cache.get_seq_length()


@pytest.mark.parametrize(
    "eos_form",
    ["int", "list", "list_pad9", "list_negative"],
    ids=["eos_int", "eos_list", "eos_list_pad9", "eos_list_negative"],
)
def test_eos_finishes_rows_early_and_pads(model, batch, eos_form):
    ids, mask = batch
    ref = reference(model, ids, mask)
    width = ids.shape[1]
    eos = eos_from(ref, width, [(0, 1), (2, 3)])
    kw = dict(eos_token_id=eos[0] if eos_form == "int" else eos)
    if eos_form == "list_negative":  # -1 matches no token in stock: it stops nothing
        kw["eos_token_id"] = [-1, *eos]
    if eos_form == "list_pad9":
        kw["pad_token_id"] = 9
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **kw
    )
    assert stock.shape[1] <= width + NEW
    assert not torch.equal(stock[:, : ref.shape[1]], ref[:, : stock.shape[1]])  # EOS mattered
    assert torch.equal(paged, stock)


@pytest.mark.parametrize(
    "lengths_kw",
    [
        dict(max_length=15),
        dict(max_new_tokens=NEW, min_new_tokens=4),
        dict(max_new_tokens=NEW, min_length=14),
        dict(max_new_tokens=4.5),  # stock stops at the first length >= L + 4.5
    ],
    ids=["max_length", "min_new_tokens", "min_length", "float_max_new_tokens"],
)
def test_length_controls(model, batch, lengths_kw):
    ids, mask = batch
    ref = reference(model, ids, mask)
    eos = eos_from(ref, ids.shape[1], [(0, 0), (1, 1), (3, 2)])
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, eos_token_id=eos, **lengths_kw
    )
    assert torch.equal(paged, stock)


def test_num_return_sequences(model, batch):
    # HF allows it only when sampling; top_k=1 makes the sampling deterministic
    ids, mask = batch
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_return_sequences=2,
        do_sample=True, top_k=1,
    )  # fmt: skip
    assert paged.shape[0] == 2 * ids.shape[0]
    assert torch.equal(paged, stock)
    torch.manual_seed(0)
    sampled = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, num_return_sequences=2,
        do_sample=True, temperature=2.0, eos_token_id=None, backend="paged",
    )  # fmt: skip
    assert sampled.shape == (2 * ids.shape[0], ids.shape[1] + NEW)
    assert torch.equal(sampled[::2, : ids.shape[1]], ids)
    assert torch.equal(sampled[1::2, : ids.shape[1]], ids)
    assert not torch.equal(sampled[::2], sampled[1::2])  # each copy samples on its own


def test_right_padding_matches_stock(model):
    ids, mask = right_pad(make_prompts([3, 6], seed=5))
    stock, paged, *_, msgs = stock_and_paged(
        model, expect_fallback=True, input_ids=ids, attention_mask=mask, max_new_tokens=NEW
    )
    assert torch.equal(paged, stock)
    assert len(msgs) == 1 and "right_padding" in msgs[0]


def test_generation_config_object_and_flat_kwargs(model, batch):
    ids, mask = batch
    ref = reference(model, ids, mask)
    eos = eos_from(ref, ids.shape[1], [(1, 2)])
    flat = dict(max_new_tokens=6, do_sample=False, eos_token_id=eos, pad_token_id=0)
    gc = GenerationConfig(**flat)
    a, b, *_ = stock_and_paged(model, input_ids=ids, attention_mask=mask, generation_config=gc)
    c, d, *_ = stock_and_paged(model, input_ids=ids, attention_mask=mask, **flat)
    assert torch.equal(a, b) and torch.equal(c, d) and torch.equal(a, c)


PROCESSORS = (
    "bad_words_ids",
    "begin_suppress_tokens",
    "forced_eos_token_id",
    "no_repeat_ngram_size",
    "repetition_penalty",
    "sequence_bias",
    "suppress_tokens",
)


def _processor_kwargs(ref, width):
    t = [int(x) for x in ref[:, width : width + 3].reshape(-1)]  # 3 new tokens per row
    return {
        "repetition_penalty": dict(repetition_penalty=1.5),
        "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
        "bad_words_ids": dict(bad_words_ids=[[t[0]], [t[4], t[5]]]),
        "suppress_tokens": dict(suppress_tokens=[t[0], t[3]]),
        "begin_suppress_tokens": dict(begin_suppress_tokens=[t[0], t[3], t[6], t[9]]),
        "sequence_bias": dict(sequence_bias=[[[t[1]], -20.0], [[t[6]], 30.0]]),
        "forced_eos_token_id": dict(forced_eos_token_id=t[2], eos_token_id=t[2]),
    }


@pytest.mark.parametrize("name", PROCESSORS)
def test_hf_processors_greedy(model, batch, name):
    ids, mask = batch
    ref = reference(model, ids, mask)
    kw = _processor_kwargs(ref, ids.shape[1])[name]
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **kw
    )
    assert not torch.equal(stock, ref)  # the processor changed something
    assert torch.equal(paged, stock)


def test_repetition_penalty_skips_left_pads(model):
    # the pad id (0) is the likeliest token nowhere else in the rows: a penalty on pads would show
    ids, mask = left_pad(make_prompts([2, 9], seed=11))
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, repetition_penalty=2.0
    )
    assert torch.equal(paged, stock)


def test_scores_and_logits_allclose(model, batch):
    ids, mask = batch
    ref = reference(model, ids, mask, repetition_penalty=1.2)
    eos = eos_from(ref, ids.shape[1], [(0, 1), (3, 4)])
    stock, paged, *_ = stock_and_paged(
        model,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        eos_token_id=eos,
        repetition_penalty=1.2,
        return_dict_in_generate=True,
        output_scores=True,
        output_logits=True,
    )
    assert (stock.sequences[:, -1] == 0).any()  # some rows finished early and were padded
    assert type(paged) is type(stock)
    assert torch.equal(paged.sequences, stock.sequences)
    assert len(paged.scores) == len(stock.scores) == stock.sequences.shape[1] - ids.shape[1]
    for name in ("scores", "logits"):
        for p, s in zip(getattr(paged, name), getattr(stock, name), strict=True):
            assert p.shape == s.shape == (ids.shape[0], 256)
            # finished rows too: the engine keeps being fed their pad tokens, like stock
            torch.testing.assert_close(p, s, atol=1e-4, rtol=1e-4)
    assert type(paged.cache) is type(stock.cache)  # its content: test_contract/cache.py
    assert paged.cache.get_seq_length() == stock.cache.get_seq_length()


@pytest.mark.parametrize("with_scores", [False, True], ids=["plain", "output_scores"])
def test_user_processors_and_criteria_see_stock_inputs(model, batch, with_scores):
    ids, mask = batch
    extra = dict(return_dict_in_generate=True, output_scores=True) if with_scores else {}

    def fresh():
        return dict(
            logits_processor=[RecordingProcessor()], stopping_criteria=[RecordingCriteria()]
        )

    stock, paged, s_extra, p_extra, _ = stock_and_paged(
        model, fresh=fresh, input_ids=ids, attention_mask=mask, max_new_tokens=NEW, **extra
    )
    if with_scores:
        stock, paged = stock.sequences, paged.sequences
    assert torch.equal(paged, stock)
    s_proc, p_proc = s_extra["logits_processor"][0], p_extra["logits_processor"][0]
    assert len(p_proc.calls) == len(s_proc.calls) > 1
    for (pi, ps), (si, ss) in zip(p_proc.calls, s_proc.calls, strict=True):
        assert torch.equal(pi, si)  # full (B, L) rows, padding included
        torch.testing.assert_close(ps, ss, atol=1e-4, rtol=1e-4)
    s_crit, p_crit = s_extra["stopping_criteria"][0], p_extra["stopping_criteria"][0]
    assert len(p_crit.calls) == len(s_crit.calls)
    for (pi, pn), (si, sn) in zip(p_crit.calls, s_crit.calls, strict=True):
        assert torch.equal(pi, si) and pn == sn  # scores: None, or a tuple of the same length
    assert (s_crit.calls[-1][1] is not None) == with_scores


def test_external_path_with_fewer_sequence_slots_than_rows(model, batch):
    # the engine runs 2 sequences per step: rows' logits arrive over several steps every round
    ids, mask = batch
    cfg = dict(SMALL_ENGINE, max_num_seqs=2)
    stock, paged, *_ = stock_and_paged(
        model, fresh=lambda: dict(logits_processor=[RecordingProcessor()]), input_ids=ids,
        attention_mask=mask, max_new_tokens=NEW, paged_config=cfg,
    )  # fmt: skip
    assert torch.equal(paged, stock)
    assert existing_owner(model).built_with.max_num_seqs == 2  # it ran there


def test_criteria_without_eos_rows_keep_generating(model, batch):
    # no EOS criterion: stock lets rows a criterion finished keep producing real tokens
    ids, mask = batch
    stock, paged, s_extra, p_extra, _ = stock_and_paged(
        model,
        fresh=lambda: dict(stopping_criteria=[RecordingCriteria(modulus=3)]),
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        eos_token_id=None,
    )
    assert torch.equal(paged, stock)
    assert len(p_extra["stopping_criteria"][0].calls) == len(s_extra["stopping_criteria"][0].calls)


@pytest.mark.parametrize("lengths", [[6], [2, 5]], ids=["batch1", "batch2"])
def test_streamer_sees_stock_stream(model, lengths):
    ids, mask = left_pad(make_prompts(lengths, seed=7))
    stock, paged, s_extra, p_extra, _ = stock_and_paged(
        model,
        fresh=lambda: dict(streamer=RecordingStreamer()),
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
    )
    assert torch.equal(paged, stock)
    s, p = s_extra["streamer"], p_extra["streamer"]
    assert len(p.puts) == len(s.puts) == NEW + 1 and p.ended == s.ended == 1
    for a, b in zip(p.puts, s.puts, strict=True):
        assert torch.equal(a, b)


def test_stop_strings(model, batch):
    ids, mask = batch
    tok = tiny_tokenizer()
    ref = reference(model, ids, mask)
    stop = tok.decode(ref[1, ids.shape[1] + 2 : ids.shape[1] + 4])
    stock, paged, *_ = stock_and_paged(
        model,
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=NEW,
        stop_strings=[stop],
        tokenizer=tok,
    )
    assert stock.shape[1] < ref.shape[1] or not torch.equal(stock, ref)
    assert torch.equal(paged, stock)


def test_eval_harness_style_call(model):
    """lm-eval's HFLM._model_generate: left-padded input_ids only (mask inferred from the pad
    id), max_length, one of lm-eval's own MultiTokenEOSCriteria per stop sequence, pad_token_id."""
    utils_hf = pytest.importorskip("lm_eval.models.utils_hf", reason="lm_eval is not installed")
    MultiTokenEOSCriteria = utils_hf.MultiTokenEOSCriteria
    tok = tiny_tokenizer()
    ids, _ = left_pad(make_prompts([3, 8, 5], seed=9), pad=tok.pad_token_id)
    ref = reference(model, ids, None, max_new_tokens=12)
    stops = [tok.decode(ref[0, ids.shape[1] + 3 : ids.shape[1] + 5]), "\n\n"]

    def fresh():
        return dict(
            stopping_criteria=[
                MultiTokenEOSCriteria(s, tok, ids.shape[1], ids.shape[0]) for s in stops
            ]
        )

    stock, paged, *_ = stock_and_paged(
        model,
        fresh=fresh,
        input_ids=ids,
        max_length=ids.shape[1] + 12,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
        do_sample=False,
    )
    assert torch.equal(paged, stock)


# ---- sampling -----------------------------------------------------------------------------


def test_native_sampling_top_k_1_is_greedy(model, batch):
    ids, mask = batch
    greedy = reference(model, ids, mask)
    torch.manual_seed(0)
    sampled = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True, top_k=1,
        temperature=0.7, backend="paged",
    )  # fmt: skip
    assert torch.equal(sampled, greedy)


def _next_token_topk(model, seqs, mask, width, k):
    """Per generated position, whether the token is among the model's top-k for its prefix."""
    full_mask = torch.cat([mask, torch.ones(seqs.shape[0], seqs.shape[1] - width)], 1).long()
    with torch.no_grad():
        logits = model(input_ids=seqs, attention_mask=full_mask).logits  # [B, T, V]
    top = logits[:, width - 1 : -1].topk(k, dim=-1).indices  # [B, new, k]
    return (top == seqs[:, width:, None]).any(-1)


def test_native_sampling_shapes_reproducible_and_in_support(model, batch):
    ids, mask = batch
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=True,
              temperature=1.5, top_k=3, top_p=0.95, eos_token_id=None)  # fmt: skip
    stock, paged, *_ = stock_and_paged(model, **kw)
    assert paged.shape == stock.shape and paged.dtype == stock.dtype
    assert torch.equal(paged[:, : ids.shape[1]], ids)
    assert _next_token_topk(model, paged, mask, ids.shape[1], 3).all()
    torch.manual_seed(1234)
    again = model.generate(**kw, backend="paged")
    assert torch.equal(again, paged)  # torch.manual_seed reproduces the call
    torch.manual_seed(99)
    other = model.generate(**kw, backend="paged")
    assert not torch.equal(other, paged)


def test_external_sampling_follows_torch_rng_like_stock(model, batch):
    # typical_p is not an engine feature: HF's warper runs on the engine's logits and the token
    # is drawn with torch.multinomial from the global RNG, exactly as stock draws it
    ids, mask = batch
    stock, paged, *_ = stock_and_paged(
        model, input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=True,
        typical_p=0.9, top_k=0, return_dict_in_generate=True, output_scores=True,
    )  # fmt: skip
    assert paged.sequences.shape == stock.sequences.shape
    for step, score in enumerate(paged.scores):
        probs = score.softmax(-1)
        torch.testing.assert_close(probs.sum(-1), torch.ones(ids.shape[0]))
        chosen = paged.sequences[:, ids.shape[1] + step]
        assert torch.isfinite(score.gather(1, chosen[:, None])).all()
    assert torch.equal(paged.sequences, stock.sequences)


def test_engine_is_reused_across_calls(model, batch):
    ids, mask = batch
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, backend="paged")
    engine = dispatch.get_engine(model)
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, backend="paged")
    assert dispatch.get_engine(model) is engine
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3"])
def test_other_families_on_the_real_engine(family):
    model = build_hf_model(family, seed=0)
    dispatch.configure(model, **SMALL_ENGINE)
    ids, mask = left_pad(make_prompts([1, 12, 5], seed=6))
    try:
        stock, paged, *_ = stock_and_paged(
            model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
        greedy_s, greedy_p, *_ = stock_and_paged(
            model, input_ids=ids, attention_mask=mask, max_new_tokens=NEW
        )
    finally:
        dispatch.release(model)
    assert torch.equal(paged.sequences, stock.sequences) and torch.equal(greedy_p, greedy_s)
    for p, s in zip(paged.logits, stock.logits, strict=True):
        torch.testing.assert_close(p, s, atol=1e-4, rtol=1e-4)


def test_user_max_length_criteria_replaces_the_default(model, batch):
    from transformers.generation.stopping_criteria import MaxLengthCriteria

    ids, mask = batch
    stock, paged, *_ = stock_and_paged(
        model,
        fresh=lambda: dict(stopping_criteria=[MaxLengthCriteria(ids.shape[1] + 6)]),
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=3,
        eos_token_id=None,
    )
    assert stock.shape[1] == ids.shape[1] + 6
    assert torch.equal(paged, stock)


@pytest.mark.parametrize("kind", ["eos", "max_length"])
def test_several_user_criteria_of_one_kind_all_stop(model, batch, kind):
    """Stock stops a row on any criterion: every EOS criterion's ids, the tightest max length
    (not only the last one of the list)."""
    from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

    ids, mask = batch
    width = ids.shape[1]
    ref = reference(model, ids, mask, eos_token_id=None)
    if kind == "eos":
        picks = eos_from(ref, width, [(1, 1), (3, 3)])
        criteria = [EosTokenCriteria(t) for t in picks]
    else:
        criteria = [MaxLengthCriteria(width + 3), MaxLengthCriteria(width + 6)]
    stock, paged, *_ = stock_and_paged(
        model, fresh=lambda: dict(stopping_criteria=list(criteria)), input_ids=ids,
        attention_mask=mask, max_new_tokens=NEW, eos_token_id=None,
    )  # fmt: skip
    if kind == "eos":  # each criterion finished its row: pads after the picked token
        assert (stock[1, width + 2 :] == 0).all() and (stock[3, width + 4 :] == 0).all()
    else:
        assert stock.shape[1] == width + 3
    assert torch.equal(paged, stock)


def test_int32_prompt_ids_come_back_int64_like_stock(model, batch):
    ids, mask = batch
    for extra in ({}, {"no_repeat_ngram_size": 2}):
        stock, paged, *_ = stock_and_paged(
            model, input_ids=ids.int(), attention_mask=mask, max_new_tokens=3, **extra
        )
        assert stock.dtype == torch.int64
        assert paged.dtype == stock.dtype and torch.equal(paged, stock)


def test_engine_built_under_inference_mode_serves_later_calls():
    """A first paged call inside ``torch.inference_mode()`` builds the engine there; it and the
    calls after the block (native, external, beams) equal stock."""
    model = build_hf_model("llama", seed=0)
    dispatch.configure(model, **SMALL_ENGINE)
    ids, mask = left_pad(make_prompts([2, 5], seed=3))
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4)
    try:
        with torch.inference_mode():
            stock, paged, *_ = stock_and_paged(model, **call)
        assert torch.equal(paged, stock)
        for extra in ({}, {"no_repeat_ngram_size": 2}, {"num_beams": 2}):
            stock, paged, *_ = stock_and_paged(model, **call, **extra)
            assert torch.equal(paged, stock), extra
    finally:
        dispatch.release(model)
