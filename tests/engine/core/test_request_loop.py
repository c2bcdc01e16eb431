"""The engine's one request loop (``engine/core/request_loop.py``): ``stream`` yields every request once with
its input index, ``run`` keeps input order, at most ``max_in_flight`` requests are in the engine,
and whatever ends the consumer early (an exception, Ctrl-C, ``close()``, a failing input
iterator) aborts what is in flight and frees every KV block. Also the pure stop rule, stop
strings against stock ``generate``, the LLM bar and tensor prompts."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.core.request_loop import RequestGroup
from hf_paged.engine.core.stop import check_stop
from hf_paged.testing import save_demo_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("demo")))


@pytest.fixture(scope="module")
def llm(path):
    with LLM(path, max_model_len=64, num_kv_blocks=64, kv_block_size=4, max_num_seqs=4) as llm:
        yield llm


def requests(n: int, max_tokens=lambda i: 3 + i % 4):
    return [
        EngineRequest([5 + i % 7, 6, 7 + i % 3], SamplingParams(
            temperature=0.0, max_tokens=max_tokens(i), ignore_eos=True))
        for i in range(n)
    ]  # fmt: skip


def assert_clean(engine):
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.runtime.num_kv_blocks
    out = engine.run(requests(2))
    assert [len(o.token_ids) for o in out] == [3, 4]


def test_stream_yields_each_once_and_run_keeps_order(llm):
    eng = llm.engine
    reqs = requests(10)
    got = list(eng.stream(reqs))
    assert sorted(i for i, _ in got) == list(range(10))
    assert [i for i, _ in got] != list(range(10))  # shorter ones finish first
    for i, out in got:
        assert len(out.token_ids) == reqs[i].params.max_tokens
    ordered = eng.run(reqs)
    assert [o.token_ids for o in ordered] == [dict(got)[i].token_ids for i in range(10)]
    ref = llm.generate([r.prompt_token_ids for r in reqs], [r.params for r in reqs],
                       use_tqdm=False)  # fmt: skip
    assert [o.token_ids for o in ref] == [o.token_ids for o in ordered]
    assert_clean(eng)


@pytest.mark.parametrize("how", ["raise", "interrupt", "close", "input_fails", "progress"])
def test_early_exit_aborts_and_frees_every_block(llm, how):
    eng = llm.engine

    def source():
        yield from requests(6, max_tokens=lambda i: 20)
        if how == "input_fails":
            raise OSError("input broke")

    def progress(n):
        if how == "progress" and eng.block_manager.num_free_blocks < eng.runtime.num_kv_blocks:
            raise KeyboardInterrupt

    err = {"raise": ValueError, "interrupt": KeyboardInterrupt, "input_fails": OSError, "close": None,
           "progress": KeyboardInterrupt}[how]  # fmt: skip
    if how == "close":
        it = eng.stream(source())
        next(it)
        assert eng.has_unfinished_requests()
        it.close()
    elif how == "raise":
        with pytest.raises(err), eng.stream(source()) as it:
            for k, _ in enumerate(it):
                if k == 1:
                    raise ValueError("consumer failed")
    else:
        with pytest.raises(err):
            for _ in eng.stream(source(), progress=progress):  # closed as the error leaves
                if how == "interrupt":
                    raise KeyboardInterrupt
    assert_clean(eng)


def test_max_in_flight_bounds_the_engine_queues(llm):
    eng = llm.engine
    pulled, seen = [0], []
    real_step = eng.step

    def step():
        seen.append(len(eng.scheduler.waiting) + len(eng.scheduler.running) + len(eng.external))
        return real_step()

    def source():
        for r in requests(12):
            pulled[0] += 1
            yield r

    eng.step = step
    try:
        it = eng.stream(source(), max_in_flight=3)
        first = next(it)
        assert pulled[0] <= 3 + 1  # lazily pulled: not the whole input up front
        rest = list(it)
    finally:
        del eng.step
    assert len(rest) + 1 == 12 and first[0] in range(12)
    assert max(seen) == 3 and pulled[0] == 12
    with pytest.raises(ValueError, match="max_in_flight=0 is not allowed"):
        eng.stream(requests(1), max_in_flight=0)


def test_iterator_default_bound_is_four_times_max_num_seqs(llm):
    eng = llm.engine
    seen = []
    real_step = eng.step
    eng.step = lambda: (seen.append(len(eng.requests)), real_step())[1]
    try:
        assert len(list(eng.stream(iter(requests(40))))) == 40
    finally:
        del eng.step
    assert max(seen) == 4 * eng.config.max_num_seqs


def test_request_group_aborts_on_error(llm):
    eng = llm.engine
    with pytest.raises(RuntimeError, match="boom"):
        with eng.request_group() as group:
            for r in requests(5, max_tokens=lambda i: 30):
                group.add(r)
            group.step()
            raise RuntimeError("boom")
    assert all(o.finish_reason == "abort" for o in group.outputs.values())
    assert isinstance(group, RequestGroup) and len(group.outputs) == 5
    assert_clean(eng)


@pytest.mark.parametrize("bad", [None, [5, 6, 7], "abc"])
def test_a_request_that_is_not_an_engine_request_is_named(llm, bad):
    # a None once ended the input silently: the requests after it were never run
    eng = llm.engine
    with pytest.raises(
        TypeError, match=r"requests\[1\]=.* is not allowed: must be an EngineRequest"
    ):
        eng.run([requests(1)[0], bad, requests(1)[0]])
    with pytest.raises(TypeError, match="request=.* is not allowed: must be an EngineRequest"):
        with eng.request_group() as group:
            group.add(bad)
    assert_clean(eng)


def _within(seconds: float, fn):
    """``fn()``'s result, or a failure (not a hang) when it runs past ``seconds``."""
    box: list = []
    worker = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert box, f"still running after {seconds} s"
    return box[0]


def test_two_streams_in_turn_and_a_generate_inside_a_stream(llm):
    # each step runs every open group's requests: one finished by another caller's step is
    # recorded in its own group (these loops once spun for ever on the requests they lost)
    eng = llm.engine
    a, b = requests(6), requests(5, max_tokens=lambda i: 2 + i)
    ref_a, ref_b = [o.token_ids for o in eng.run(a)], [o.token_ids for o in eng.run(b)]

    def in_turn():
        got = {"a": {}, "b": {}}
        streams = {"a": eng.stream(a), "b": eng.stream(b)}
        while streams:
            for name, it in list(streams.items()):
                nxt = next(it, None)
                if nxt is None:
                    del streams[name]
                else:
                    got[name][nxt[0]] = nxt[1].token_ids
        return got

    got = _within(60, in_turn)
    assert [got["a"][i] for i in range(6)] == ref_a
    assert [got["b"][i] for i in range(5)] == ref_b

    def nested():
        outer, inner = {}, None
        for i, out in eng.stream(a):
            outer[i] = out.token_ids
            if inner is None:
                inner = llm.generate([r.prompt_token_ids for r in b], [r.params for r in b],
                                     use_tqdm=False)  # fmt: skip
        return outer, [o.token_ids for o in inner]

    outer, inner = _within(60, nested)
    assert [outer[i] for i in range(6)] == ref_a and inner == ref_b
    assert_clean(eng)


def test_check_stop_rule():
    p = SamplingParams(max_tokens=5, min_tokens=2)
    assert check_stop(1, 9, 4, p, (9,), 64) is None  # a stop id before min_tokens
    assert check_stop(2, 9, 5, p, (9,), 64) == "stop"
    assert check_stop(2, 8, 5, p, (9,), 64) is None
    assert check_stop(2, 8, 5, p, (9,), 64, stop_string_hit=True) == "stop"
    assert check_stop(5, 8, 8, p, (9,), 64) == "length"
    assert check_stop(5, 9, 8, p, (9,), 64) == "stop"  # a stop on the last token is a stop
    assert check_stop(3, 8, 64, p, (9,), 64) == "length"  # max_model_len
    assert check_stop(5, None, 8, p, (9,), 64) == "length"  # value unknown: lengths only
    assert check_stop(3, None, 8, p, (9,), 64) is None


def test_stop_strings_equal_stock_stop_strings(llm, path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = llm.tokenizer
    prompts = ["hello wor", "abc", "The cat sat"]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    for prompt, out in zip(prompts, free, strict=True):
        new = out.token_ids
        # stop strings the model really emits: two tokens from the middle, and one that starts
        # in the prompt and ends in the first new token
        for stop in ([tok.decode(new[4:6])], [prompt[-1] + tok.decode(new[:1]), "zzzz"]):
            ids = tok(prompt, return_tensors="pt")["input_ids"]
            ref = hf.generate(ids, max_new_tokens=12, do_sample=False, stop_strings=stop,
                              tokenizer=tok, eos_token_id=None, pad_token_id=0)  # fmt: skip
            want = ref[0, ids.shape[1] :].tolist()
            params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=stop)
            got = llm.generate([prompt], params, use_tqdm=False)[0]
            assert got.token_ids == want, (prompt, stop)
            assert got.finish_reason == ("stop" if len(want) < 12 else "length")
            assert len(want) < 12 or stop == ["zzzz"]
    with pytest.raises(ValueError, match="stop=.*non-empty strings"):
        SamplingParams(stop=["a", ""])
    assert SamplingParams(stop="ab").stop == ("ab",)


def test_stop_strings_need_a_tokenizer(path):
    with LLM(path, tokenizer=None, num_kv_blocks=16) as llm:
        llm.engine.tokenizer = None
        with pytest.raises(ValueError, match="stop=\\('x',\\) is not allowed without a tokenizer"):
            llm.generate([[5, 6]], SamplingParams(stop=["x"]), use_tqdm=False)
        assert not llm.engine.has_unfinished_requests()


def test_tensor_prompts(llm):
    one = llm.generate(torch.tensor([5, 6, 7]), GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].prompt_token_ids == [5, 6, 7]
    two = llm.generate(torch.tensor([[5, 6, 7], [8, 9, 10]]), GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in two] == [[5, 6, 7], [8, 9, 10]]
    assert two[0].token_ids == one[0].token_ids
    with pytest.raises(ValueError, match="prompts=<tensor of shape \\(1, 1, 2\\)>"):
        llm.generate(torch.ones(1, 1, 2, dtype=torch.long), GREEDY, use_tqdm=False)


def test_llm_bar_counts_tokens_per_step(llm, monkeypatch):
    import hf_paged.entrypoints.llm as llm_mod

    bars = []

    class Bar(llm_mod.tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.updates = []
            bars.append(self)

        def update(self, n=1):
            self.updates.append(n)
            return super().update(n)

    monkeypatch.setattr(llm_mod, "tqdm", Bar)
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 2 * i, ignore_eos=True)
              for i in range(4)]  # fmt: skip
    llm.generate([[5, 6], [7], [8, 9, 10], [11]], params, use_tqdm=True)
    (bar,) = bars
    assert bar.total == sum(p.max_tokens for p in params) and bar.n == bar.total
    assert len(bar.updates) > max(p.max_tokens for p in params)  # at least once per step
    assert bar.updates[0] == 4  # the first step samples a token for each of the 4 prompts


def test_stop_strings_overlapped_equal_sync(llm, path):
    """Stop strings under overlapped stepping: matched when a token's value reaches the host
    (the in-flight token after it dropped), with the tokens and reasons of synchronous steps."""
    tok = llm.tokenizer
    prompts = ["hello wor", "abc", "The cat sat", "xy", "0123456789"]
    free = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)  # fmt: skip
    params = []
    for i, out in enumerate(free):
        new = out.token_ids  # a string the model emits: early, at its last token, or never
        stop = [tok.decode(new[2:4])] if i % 3 == 0 else [tok.decode(new[-1:])] if i % 3 == 1 \
            else ["zzzz"]  # fmt: skip
        params.append(SamplingParams(temperature=0.0, max_tokens=12 - i % 2, ignore_eos=True,
                                     stop=stop, min_tokens=i % 3))  # fmt: skip
    sync = [(o.token_ids, o.finish_reason) for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, max_model_len=64, num_kv_blocks=64, kv_block_size=4, max_num_seqs=4,
             async_scheduling=True) as over:  # fmt: skip
        got = over.generate(prompts, params, use_tqdm=False)
        assert over.stats["num_overlapped_steps"] > 0
    assert [(o.token_ids, o.finish_reason) for o in got] == sync
    assert {r for _, r in sync} == {"stop", "length"}


def test_group_without_kept_outputs_awaits_logits_and_keeps_nothing(llm):
    """A long-lived group (a draft model's) awaits logits through the loop and keeps no output
    of its aborted requests; a request the engine ends itself is named."""
    eng = llm.engine
    group = RequestGroup(eng, keep_outputs=False)
    params = SamplingParams(temperature=0.0, max_tokens=1)
    rids = [group.add(EngineRequest([5, 6, 7 + i], params, external_sampling=True))
            for i in range(3)]  # fmt: skip
    got = group.await_logits([(r, 0) for r in rids], budget=20)
    assert set(got) == {(r, 0) for r in rids} and all(eng.awaits_token(r) for r in rids)
    for r in rids:
        group.close(r)
    group.drain()
    assert group.outputs == {} and group.rids == [] and group.take_finished() == []
    assert_clean(eng)
