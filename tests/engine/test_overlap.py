"""Overlapped stepping (async_scheduling=True) gives exactly what synchronous stepping gives:
greedy parity with HF under preemption, chunking and prefix caching; EOS / stop ids / min_tokens
and finish reasons; seeded sampling; requests that force synchronous steps mixed in."""

from __future__ import annotations

import pytest

from hf_paged import LLM, SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.testing import hf_greedy, paged_greedy, spread_prompts
from hf_paged.testing.parity import NEW_TOKENS

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module", params=["qwen3", "mistral"])
def variant(request, tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    from hf_paged.testing import save_tiny_model

    overrides = {"sliding_window": 12} if request.param == "mistral" else {}
    path = str(tmp_path_factory.mktemp(request.param))
    save_tiny_model(request.param, path, seed=0, **overrides)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize(
    "engine",
    [
        {},
        {"num_kv_blocks": 16},  # preemption
        {"max_num_batched_tokens": 6, "max_num_seqs": 6},  # chunked prefill
        {"max_num_seqs": 4},  # queueing + prefix cache on shared prompts below
    ],
    ids=["defaults", "preempt", "chunked", "queued"],
)
def test_greedy_parity(variant, engine):
    path, hf = variant
    shared = [7 + (i * 13) % 240 for i in range(17)]
    prompts = spread_prompts(8, 2, 30, seed=11) + spread_prompts(8, 1, 10, seed=12, prefix=shared)
    got, stats = paged_greedy(path, prompts, async_scheduling=True, **engine)
    assert stats["num_overlapped_steps"] >= NEW_TOKENS
    if "num_kv_blocks" in engine:
        assert stats["num_preemptions"] > 0
    assert got == hf_greedy(hf, prompts)


def run(path, prompts, params, **kw):
    cfg = dict(max_model_len=128, kv_block_size=8, num_kv_blocks=256, max_num_seqs=8)
    cfg.update(kw)
    with LLM(path, **cfg) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = llm.stats
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
        assert (stats["num_overlapped_steps"] > 0) == cfg.get("async_scheduling", False)
        assert not llm.engine.has_unfinished_requests()
    return [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]


def test_stops_and_reasons_equal_sync(variant):
    path, _ = variant
    prompts = spread_prompts(12, 1, 20, seed=21)
    base = run(path, prompts, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    # stop on tokens each sequence really emits: at its 3rd token, or at its last one
    params = []
    for i, ((toks, _),) in enumerate(base):
        stop = toks[2] if i % 3 else toks[-1]
        params.append(SamplingParams(temperature=0.0, max_tokens=20 - i % 4, stop_token_ids=[stop],
                                     min_tokens=i % 5, ignore_eos=True))  # fmt: skip
    sync = run(path, prompts, params)
    assert run(path, prompts, params, async_scheduling=True) == sync
    assert {r for o in sync for _, r in o} == {"stop", "length"}


def test_seeded_sampling_and_n_equal_sync(variant):
    path, _ = variant
    prompts = spread_prompts(6, 1, 20, seed=31)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, seed=i, n=1 + i % 3,
                             ignore_eos=True) for i in range(len(prompts))]  # fmt: skip
    assert run(path, prompts, params, async_scheduling=True) == run(path, prompts, params)


def test_sync_only_requests_mixed_in(variant):
    path, _ = variant
    prompts = spread_prompts(8, 1, 20, seed=41)
    params = [
        SamplingParams(temperature=0.0, max_tokens=10 + i, ignore_eos=True,
                       repetition_penalty=1.3 if i % 4 == 0 else 1.0,
                       logprobs=1 if i == 3 else None)
        for i in range(len(prompts))
    ]  # fmt: skip
    assert run(path, prompts, params, async_scheduling=True) == run(path, prompts, params)
    with LLM(path, async_scheduling=True, num_kv_blocks=64, kv_block_size=8) as llm:
        eng = llm.engine  # a greedy request in flight, then a penalised one joins
        a = eng.add_request(EngineRequest([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6)))
        eng.step()
        eng.step()
        b = eng.add_request(EngineRequest([8, 9], SamplingParams(temperature=0.0, max_tokens=4,
                                                   repetition_penalty=1.5)))  # fmt: skip
        done = {}
        while eng.has_unfinished_requests():
            done.update({o.request_id: o for o in eng.step().finished})
        assert len(done[a].token_ids) == 6 and len(done[b].token_ids) == 4
        assert all(t >= 0 for o in done.values() for t in o.token_ids)  # no placeholder left


def test_async_needs_one_rank():
    from hf_paged import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling=True .* tensor_parallel_size=2"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    EngineConfig(tensor_parallel_size=2)  # the default (None = auto) is allowed: sync there
    with pytest.raises(ValueError, match="async_scheduling.*a bool or None"):
        EngineConfig(async_scheduling="yes")


def test_default_is_auto_sync_on_cpu(variant):
    from hf_paged import LLM

    with LLM(variant[0]) as llm:
        assert llm.engine.config.async_scheduling is None
        assert llm.engine.overlap is None  # CPU: nothing to hide
    with LLM(variant[0], async_scheduling=True) as llm:
        assert llm.engine.overlap is not None


def test_stop_on_the_token_before_the_length_limit(variant):
    """A stop id at new token k with max_tokens=k+2: overlapped stepping ends the sequence by
    length at launch of token k+1 before token k's value is known; it must still report the
    stop at k, as synchronous stepping does."""
    path, _ = variant
    prompts = spread_prompts(8, 1, 20, seed=51)
    base = run(path, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    chosen, params = [], []
    for prompt, ((toks, _),) in zip(prompts, base):  # k: the first new token new to the output
        k = next((k for k in range(1, 10) if toks[k] not in toks[:k]), None)
        if k is not None:
            chosen.append(prompt)
            params.append(SamplingParams(temperature=0.0, max_tokens=k + 2, ignore_eos=True,
                                         stop_token_ids=[toks[k]]))  # fmt: skip
    assert len(chosen) >= 4
    sync = run(path, chosen, params)
    assert all(r == "stop" and len(t) == p.max_tokens - 1 for ((t, r),), p in zip(sync, params))
    assert run(path, chosen, params, async_scheduling=True) == sync
