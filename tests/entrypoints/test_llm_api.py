"""The LLM API: bad input gives a clear error and leaves the engine usable; strings, n, seeds,
logprobs, stop ids and per-prompt params behave as documented."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_paged import LLM, EngineConfig, SamplingParams
from hf_paged.testing import build_char_tokenizer, save_demo_model, save_tiny_model


@pytest.fixture(autouse=True, scope="module")
def _engine_threads(one_thread):
    """``one_thread`` (tests/conftest.py): tiny engines run fastest on one thread."""
    yield


GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = save_demo_model(str(tmp_path_factory.mktemp("demo")))
    with LLM(path, max_model_len=64, num_kv_blocks=64, kv_block_size=8) as llm:
        yield llm


def still_works(llm):
    out = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    assert len(out[0].token_ids) == 8
    assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]


@pytest.mark.parametrize(
    "prompt, match",
    [
        ([1] * 64, r"prompt length 64 .* max_model_len=64"),
        ([], r"prompt_token_ids=\[\] .* at least 1 token"),
        ([5, 99999], r"prompt_token_ids\[1\]=99999 .* \[0, 99\)"),
        ([5, -1], r"prompt_token_ids\[1\]=-1"),
        ([5, 2.0], r"prompt_token_ids\[1\]=2.0"),
        ([5, True], r"prompt_token_ids\[1\]=True"),
    ],
)
def test_bad_prompt(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([[4, 5], prompt], GREEDY, use_tqdm=False)  # the good one is not queued
    assert not llm.engine.has_unfinished_requests()
    still_works(llm)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, r"temperature=-0.5 .* temperature must be"),
        ({"top_p": 0.0}, r"top_p=0.0 .* \(0.0, 1.0\]"),
        ({"top_p": 1.5}, r"top_p=1.5"),
        ({"top_k": -2}, r"top_k=-2 .* >= -1"),
        ({"max_tokens": 0}, r"max_tokens=0 .* >= 1"),
        ({"min_p": 2.0}, r"min_p=2.0"),
        ({"n": 0}, r"n=0"),
        ({"stop_token_ids": [1, -3]}, r"stop_token_ids"),
    ],
)
def test_bad_sampling_params(llm, kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
    still_works(llm)


def test_unknown_keys():
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['max_num_seq'\].*max_num_seqs"):
        EngineConfig.from_dict({"max_num_seq": 4})
    with pytest.raises(TypeError, match="bogus"):
        SamplingParams.from_dict({"bogus": 1})
    with pytest.raises(ValueError, match=r"kv_block_size=0"):
        EngineConfig(kv_block_size=0)
    with pytest.raises(ValueError, match=r"dtype='fp8'"):
        EngineConfig(dtype="fp8")


def test_unknown_engine_kwarg(llm, tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "m"))
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(path, max_num_seq=3)


def test_unsupported_architecture(tmp_path, monkeypatch):
    from transformers import MambaConfig, MambaForCausalLM

    from hf_paged.models.recurrent import registry

    monkeypatch.setitem(registry.MIXERS, "MambaMixer", None)  # a recurrent layer with no mixer
    cfg = MambaConfig(hidden_size=32, num_hidden_layers=1, vocab_size=64, state_size=4)
    MambaForCausalLM(cfg).save_pretrained(tmp_path)
    with pytest.raises(
        ValueError, match=r"MambaForCausalLM has recurrent layers no mixer .*MambaMixer"
    ):
        LLM(str(tmp_path))


def test_model_with_a_forward_hook_is_refused_by_name():
    from hf_paged.testing import build_hf_model

    model = build_hf_model("llama", seed=0)
    handle = model.lm_head.register_forward_hook(lambda mod, args, out: -out)
    with pytest.raises(ValueError, match=r"forward hook .* on 'lm_head' .*\[module_hooks\]"):
        LLM(model, num_kv_blocks=16, kv_block_size=8)
    handle.remove()
    with LLM(model, num_kv_blocks=16, kv_block_size=8) as llm:
        assert len(llm.generate([[3, 4]], GREEDY, use_tqdm=False)[0].token_ids) == 8


def test_kv_budget_too_small(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "m"))
    with pytest.raises(ValueError, match="max_model_len=128 needs 16"):
        LLM(path, num_kv_blocks=3, kv_block_size=8)


def test_strings_need_tokenizer(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "m"))
    with LLM(path, num_kv_blocks=32, kv_block_size=8) as llm:
        with pytest.raises(ValueError, match="without a tokenizer"):
            llm.generate(["hello"], GREEDY, use_tqdm=False)
        assert len(llm.generate([[3, 4]], GREEDY, use_tqdm=False)[0].token_ids) == 8
    with LLM(path, tokenizer=build_char_tokenizer(), num_kv_blocks=32, kv_block_size=8) as llm:
        assert isinstance(llm.generate("hi", GREEDY, use_tqdm=False)[0].text, str)


def test_numpy_and_tensor_prompts(llm):
    import numpy as np

    ref = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    for prompt in (np.array([5, 6, 7]), torch.tensor([5, 6, 7])):
        assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].token_ids == ref
        # one 1-D array alone is one prompt, as a 1-D tensor is (numpy ids were taken as prompts)
        assert [o.token_ids for o in llm.generate(prompt, GREEDY, use_tqdm=False)] == [ref]
    rows = [o.token_ids for o in llm.generate(np.array([[5, 6, 7], [5, 6, 7]]), GREEDY, use_tqdm=False)]  # fmt: skip
    ragged = np.empty(2, dtype=object)  # a ragged column of ids
    ragged[:] = [np.array([5, 6, 7]), np.array([5, 6, 7])]
    assert rows == [o.token_ids for o in llm.generate(ragged, GREEDY, use_tqdm=False)] == [ref] * 2


@pytest.mark.parametrize("prompt", [None, b"ab", 5])
def test_prompt_that_is_no_sequence_of_ids(llm, prompt):
    with pytest.raises(TypeError, match=r"prompt_token_ids=.* is not allowed: must be a list"):
        llm.generate([[4, 5], prompt], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    still_works(llm)


def test_params_list_length(llm):
    with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2"):
        llm.generate([[3], [4]], [GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match=r"sampling_params\[1\]='bad'"):
        llm.generate([[3], [4]], [GREEDY, "bad"], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()  # nothing was queued
    still_works(llm)


def test_text_order_and_per_prompt_params(llm):
    prompts = ["Hello", "A much longer prompt than the first one", "x"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 7, 5]
    tok = llm.tokenizer
    for p, o in zip(prompts, outs):
        assert o.prompt == p and o.prompt_token_ids == tok.encode(p)
        assert o.text == tok.decode(o.token_ids, skip_special_tokens=True)
    alone = llm.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert alone.token_ids == outs[1].token_ids


def test_seed_and_n(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], sp, use_tqdm=False)[0].token_ids
    batch = llm.generate(
        [[20, 21], [10, 11, 12], [30]],
        [SamplingParams(temperature=1.0, max_tokens=12), sp, SamplingParams(temperature=0.7)],
        use_tqdm=False,
    )
    assert batch[1].token_ids == alone
    multi = llm.generate([[10, 11, 12]], dataclasses.replace(sp, n=3), use_tqdm=False)[0]
    assert len(multi.outputs) == 3 and multi.outputs[0].token_ids == alone
    assert len({tuple(o.token_ids) for o in multi.outputs}) > 1


def test_stop_ids_and_logprobs(llm):
    base = llm.generate(
        [[40, 41, 42]],
        SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )[0]
    stop = base.token_ids[3]
    first = base.token_ids.index(stop)
    out = llm.generate(
        [[40, 41, 42]],
        SamplingParams(temperature=0.0, max_tokens=10, stop_token_ids=[stop], logprobs=2),
        use_tqdm=False,
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
    assert len(out.logprobs) == len(out.token_ids)
    for tok, (lp, top) in zip(out.token_ids, out.logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(lp)  # greedy = top-1
        assert tok in top


def test_eos_stops(tmp_path):
    path = save_tiny_model("qwen3", str(tmp_path / "m"))
    with LLM(path, num_kv_blocks=32, kv_block_size=8) as llm:
        base = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0].token_ids
        eos = base[2]
        llm.engine.runtime.eos_token_ids = (eos,)
        out = llm.generate(
            [[9, 8, 7]], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
        )[0]
        assert out.finish_reason == "stop" and out.token_ids == base[: base.index(eos) + 1]
        ignored = llm.generate([[9, 8, 7]], GREEDY, use_tqdm=False)[0]
        assert ignored.token_ids == base
    assert torch.get_default_dtype() == torch.float32  # nothing global left changed


def test_a_closed_llm_says_so(tmp_path):
    """generate / engine / stats after close() raise a RuntimeError naming it (they raised
    AttributeError: 'NoneType' object has no attribute 'tokenizer'); close is idempotent."""
    path = save_demo_model(str(tmp_path / "m"))
    llm = LLM(path, max_model_len=32, num_kv_blocks=8, kv_block_size=8)
    assert len(llm.generate([[5, 6]], GREEDY, use_tqdm=False)[0].token_ids) == 8
    llm.close()
    llm.close()
    for use in (lambda: llm.generate(["ab"], GREEDY, use_tqdm=False), lambda: llm.stats):
        with pytest.raises(RuntimeError, match="this LLM is closed"):
            use()


def test_vllm_prompt_dicts(llm):
    """vLLM's TextPrompt / TokensPrompt dicts are prompts (they raised TypeError); other keys
    are refused by name."""
    ids = llm.tokenizer.encode("Hello")
    ref = llm.generate("Hello", GREEDY, use_tqdm=False)[0]
    outs = llm.generate([{"prompt": "Hello"}, {"prompt_token_ids": ids}], GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [ref.token_ids] * 2
    assert [o.prompt for o in outs] == ["Hello", None] and outs[1].prompt_token_ids == ids
    assert llm.generate({"prompt": "Hello"}, GREEDY, use_tqdm=False)[0].token_ids == ref.token_ids
    with pytest.raises(ValueError, match=r"keys \['multi_modal_data', 'prompt'\]"):
        llm.generate([{"prompt": "a", "multi_modal_data": {}}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids='ab'"):
        llm.generate([[4, 5], {"prompt_token_ids": "ab"}], GREEDY, use_tqdm=False)
    still_works(llm)


def test_max_tokens_none_runs_to_max_model_len(llm):
    """max_tokens=None is vLLM's "up to max_model_len" (it was refused)."""
    from hf_paged.engine.core.request import EngineRequest

    prompt = [5, 6, 7] * 18  # 54 tokens: 10 left under max_model_len=64
    none = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
    out = llm.generate([prompt], none, use_tqdm=False)[0]
    ref = llm.generate([prompt], dataclasses.replace(none, max_tokens=10), use_tqdm=False)[0]
    assert out.token_ids == ref.token_ids and out.finish_reason == "length"
    assert llm.engine.run([EngineRequest(prompt, none)])[0].token_ids == ref.token_ids
    with pytest.raises(ValueError, match=r"min_tokens=11 .* room for 10 under max_model_len=64"):
        llm.generate([prompt], dataclasses.replace(none, min_tokens=11), use_tqdm=False)
    still_works(llm)


def test_vllm_output_fields_and_tokenizer(llm):
    """RequestOutput.finished, CompletionOutput.cumulative_logprob and LLM.get_tokenizer, as
    vLLM's."""
    out = llm.generate("Hi", dataclasses.replace(GREEDY, logprobs=1), use_tqdm=False)[0]
    assert out.finished
    total = sum(lp for lp, _top in out.logprobs)
    assert out.outputs[0].cumulative_logprob == pytest.approx(total) and total < 0
    assert llm.generate("Hi", GREEDY, use_tqdm=False)[0].outputs[0].cumulative_logprob is None
    assert llm.get_tokenizer() is llm.tokenizer


def test_chat_renders_the_template(llm):
    conv = [{"role": "user", "content": "hi"}]
    text = llm.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    ref = llm.generate([llm.tokenizer.encode(text, add_special_tokens=False)], GREEDY,
                       use_tqdm=False)[0]  # fmt: skip
    outs = llm.chat([conv, conv + [{"role": "assistant", "content": "yo"}]], GREEDY,
                    use_tqdm=False)  # fmt: skip
    assert outs[0].prompt == text and outs[0].token_ids == ref.token_ids
    assert outs[1].prompt.endswith("<assistant>yo\n<assistant>")
    assert llm.chat(conv, GREEDY, use_tqdm=False)[0].token_ids == ref.token_ids
