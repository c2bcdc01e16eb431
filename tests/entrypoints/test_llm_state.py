"""LLM over an in-memory model sees weight changes made between calls, and calls from several
threads each get their own correct outputs."""

from __future__ import annotations

import threading

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing import build_hf_model


@pytest.fixture(autouse=True, scope="module")
def _engine_threads(one_thread):
    """``one_thread`` (tests/conftest.py): tiny engines run fastest on one thread."""
    yield


PROMPTS = [[3, 14, 15, 92], [6], [5, 35, 89, 79, 32, 38, 46, 26, 43]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def stock(model, prompt):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                         min_new_tokens=12, do_sample=False, eos_token_id=None,
                         pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def test_in_place_update_rebuilds_the_engine():
    model = build_hf_model("llama", 0).eval()
    with LLM(model, max_model_len=64, num_kv_blocks=32, kv_block_size=4) as llm:
        before = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        assert before == [stock(model, p) for p in PROMPTS]
        with torch.no_grad():  # an RL step: q_proj is fused into the engine's qkv copy
            for layer in model.model.layers:
                layer.self_attn.q_proj.weight.mul_(-2.0)
                layer.mlp.up_proj.weight.add_(0.05)
        after = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
        want = [stock(model, p) for p in PROMPTS]
        assert want != before  # the update matters
        assert after == want


def test_threads_share_one_llm():
    model = build_hf_model("llama", 0).eval()
    want = [stock(model, p) for p in PROMPTS]
    with LLM(model, max_model_len=64, num_kv_blocks=64, kv_block_size=4) as llm:
        results, errors = {}, []

        def worker(i):
            try:
                order = PROMPTS[i % 3 :] + PROMPTS[: i % 3]
                for _ in range(3):
                    outs = llm.generate(order, GREEDY, use_tqdm=False)
                    results.setdefault(i, []).append([o.token_ids for o in outs])
            except Exception as e:  # reported below, with the thread's index
                errors.append((i, e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert not errors
        for i, runs in results.items():
            order = want[i % 3 :] + want[: i % 3]
            assert runs == [order] * 3
        assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]
