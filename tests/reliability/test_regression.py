"""What held when issue 14 was filed, kept as bounded regression tests (tp=1, CPU, tiny llama).

Many prompts in one call come back in order; a soak keeps descriptors, /dev/shm, memory and KV
blocks flat; threads sharing one LLM each get their own outputs; exceptions from a user's
criteria, processors and streamers leave the engine usable; KV pressure changes nothing.
"""

from __future__ import annotations

import os
import random
import resource
import threading

import pytest
import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

import hf_paged
from hf_paged import LLM, SamplingParams
from hf_paged.integration import dispatch
from hf_paged.testing import build_hf_model, save_tiny_model
from hf_paged.testing.procfs import fd_targets, shm_files

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = dict(max_model_len=64, kv_block_size=4, num_kv_blocks=256, max_num_seqs=64)
NUM_PROMPTS = 500
SOAK_CALLS = 30


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(rng.randint(1, 12))] for _ in range(n)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return save_tiny_model("llama", str(tmp_path_factory.mktemp("regr") / "llama"), seed=5)


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(ckpt, **ENGINE) as engine:
        yield engine


def _ids(outs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outs]


def test_many_prompts_in_one_call_come_back_in_order(llm):
    prompts = _prompts(NUM_PROMPTS, seed=0)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [list(o.prompt_token_ids) for o in outs] == prompts
    sample = list(range(0, NUM_PROMPTS, 50))  # each equals its own run alone
    alone = [_ids(llm.generate([prompts[i]], GREEDY, use_tqdm=False))[0] for i in sample]
    assert [_ids(outs)[i] for i in sample] == alone


def _held() -> tuple[int, int]:
    fds = fd_targets(os.getpid())
    return len(fds), len(shm_files(os.getpid()))


def test_soak_keeps_descriptors_shm_memory_and_blocks_flat(llm):
    prompts = _prompts(24, seed=1)
    ref = _ids(llm.generate(prompts, GREEDY, use_tqdm=False))
    free = llm.stats["num_free_blocks"]
    held = _held()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB, high-water mark
    for _ in range(SOAK_CALLS):
        assert _ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == ref
        assert llm.stats["num_free_blocks"] == free
    assert _held() == held
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 * 1024


def test_kv_pressure_gives_the_unconstrained_outputs(ckpt, llm):
    prompts = _prompts(16, seed=2)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ref = _ids(llm.generate(prompts, long, use_tqdm=False))
    with LLM(ckpt, **{**ENGINE, "num_kv_blocks": 16, "max_num_seqs": 16}) as tight:
        got = _ids(tight.generate(prompts, long, use_tqdm=False))
        assert tight.stats["num_preemptions"] > 0
    assert got == ref


# ---- user code that raises, through generate(backend="paged") ------------------------------


class Boom(RuntimeError):
    pass


class RaisingCriteria(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise Boom("criteria")


class RaisingProcessor(LogitsProcessor):
    def __call__(self, input_ids, scores):
        raise Boom("processor")


class RaisingStreamer(BaseStreamer):
    def __init__(self):
        self.calls = 0

    def put(self, value):
        self.calls += 1
        if self.calls == 3:
            raise Boom("streamer")

    def end(self):
        pass


@pytest.fixture(scope="module")
def hf_model():
    return build_hf_model("llama", seed=6).eval()


@pytest.mark.parametrize(
    "extra",
    [
        {"stopping_criteria": [RaisingCriteria()]},
        {"logits_processor": [RaisingProcessor()]},
        {"streamer": RaisingStreamer()},
    ],
    ids=["criteria", "processor", "streamer"],
)
def test_user_exceptions_leave_the_engine_usable(hf_model, extra):
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)
    kw.update(do_sample=False, pad_token_id=0)
    stock = hf_model.generate(**kw)
    config = dict(num_kv_blocks=32, kv_block_size=4)
    with pytest.raises(Boom):
        hf_model.generate(**kw, **extra, backend="paged", paged_config=config)
    assert torch.equal(hf_model.generate(**kw, backend="paged", paged_config=config), stock)


def test_four_threads_on_one_model_get_their_own_outputs(hf_model):
    config = dict(num_kv_blocks=64, kv_block_size=4)
    work = [torch.tensor(_prompts(1, seed=20 + t) * 3)[:, :1].repeat(1, 5) + t for t in range(4)]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ref = [hf_model.generate(ids, **kw) for ids in work]
    got: dict = {}

    def run(t: int) -> None:
        got[t] = [hf_model.generate(work[t], **kw, backend="paged", paged_config=config)
                  for _ in range(3)]  # fmt: skip

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(got) == [0, 1, 2, 3]
    for t in range(4):
        assert all(torch.equal(out, ref[t]) for out in got[t]), t


# ---- closing an engine while a call runs on it ------------------------------------------------


class CallbackStreamer(BaseStreamer):
    """Calls ``fn`` at the third ``put`` (the prompt, then two new tokens)."""

    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def put(self, value):
        self.calls += 1
        if self.calls == 3:
            self.fn()

    def end(self):
        pass


def _release_from_another_thread(model):
    """A ``fn`` for CallbackStreamer: another thread releases ``model``'s engine while the call
    waits (it resumes once the release returned)."""

    def fn():
        releaser = threading.Thread(target=hf_paged.release, args=(model,))
        releaser.start()
        releaser.join(30)
        assert not releaser.is_alive()

    return fn


@pytest.mark.parametrize("where", ["same_thread", "other_thread"])
def test_release_during_a_paged_call_closes_the_engine_after_it(hf_model, where):
    # the close waits for the running call: closed under it, the call once died with "this
    # KVCache was released" / "this engine is closed"
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6)
    kw.update(do_sample=False, pad_token_id=0, backend="paged")
    config = dict(num_kv_blocks=32, kv_block_size=4)
    stock = hf_model.generate(**{**kw, "backend": "hf"})
    fn = (lambda: hf_paged.release(hf_model)) if where == "same_thread" else (
        _release_from_another_thread(hf_model))  # fmt: skip
    assert torch.equal(hf_model.generate(**kw, streamer=CallbackStreamer(fn), paged_config=config),
                       stock)  # fmt: skip
    assert dispatch.owner(hf_model).engine is None  # closed once the call ended
    assert torch.equal(hf_model.generate(**kw, paged_config=config), stock)


def test_llm_close_from_another_thread_lets_the_running_generate_finish(ckpt):
    llm = LLM(ckpt, **ENGINE)
    engine, real_step, steps = llm.engine, llm.engine.step, []

    def step():
        steps.append(1)
        if len(steps) == 2:  # mid-run: another thread closes the LLM
            closer = threading.Thread(target=llm.close)
            closer.start()
            closer.join(30)
        return real_step()

    engine.step = step
    outs = llm.generate(_prompts(4, seed=3), GREEDY, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * 4
    with pytest.raises(RuntimeError, match="this LLM is closed"):
        llm.generate([[5, 6]], GREEDY, use_tqdm=False)
