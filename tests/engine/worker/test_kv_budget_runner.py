"""The ModelRunner sizes its KV cache from a memory probe, registers what it holds, and gives it
back on close; on CPU, with a fake probe standing in for ``torch.cuda``'s memory queries.

The fake device's usage is what the live engines registered (their KV caches) plus a fixed
CUDA context and cached activation blocks, so engines built one after another see each other.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.worker import runner_memory
from hf_paged.engine.worker.kv_budget import LIVE_ENGINES, DeviceMemory, KVCacheMemoryError, MiB
from hf_paged.testing import save_demo_model, save_tiny_model

TOTAL = 64 * MiB
ENGINE = dict(device="cpu", max_model_len=128, max_num_batched_tokens=128, max_num_seqs=4)


class FakeProbe:
    """A 64 MiB "GPU": 2 MiB context outside torch, 1 MiB cached free, 3 MiB activation peak."""

    def __init__(self):
        self.released = 0

    def allocated(self) -> int:
        return sum(e.weights + e.kv_cache for e in LIVE_ENGINES.on("cpu"))

    def reserved(self) -> int:
        return self.allocated() + MiB

    def read(self) -> DeviceMemory:
        reserved = self.reserved()
        return DeviceMemory(TOTAL, TOTAL - 2 * MiB - reserved, reserved, self.allocated())

    def reset_peak(self) -> None:
        pass

    def peak_allocated(self) -> int:
        return self.allocated() + 3 * MiB

    def release_cached(self, collect: bool = True) -> None:
        self.released += 1


@pytest.fixture
def probe(monkeypatch):
    fake = FakeProbe()
    monkeypatch.setattr(runner_memory, "probe_for", lambda device: fake)
    yield fake
    assert LIVE_ENGINES.on("cpu") == [], "an engine stayed registered"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_demo_model(str(tmp_path_factory.mktemp("kv") / "m"))


def test_blocks_come_from_the_share_and_close_gives_them_back(probe, model):
    with LLM(model, gpu_memory_utilization=0.5, **ENGINE) as llm:
        runner = llm.engine.executor.runner
        block = runner.kv_block_bytes()
        assert runner.activation_peak_bytes == 3 * MiB
        assert llm.stats["num_kv_blocks"] == (TOTAL // 2 - 3 * MiB) // block
        assert runner.memory.plan.num_blocks == llm.stats["num_kv_blocks"]
        (mine,) = LIVE_ENGINES.on("cpu")
        assert mine.kv_cache == runner.kv_cache.nbytes() == runner.memory.plan.kv_bytes
        assert "Qwen3ForCausalLM (max_model_len=128)" in mine.name
        out = llm.generate([[5, 6, 7]], use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) > 0
        released = probe.released
    assert LIVE_ENGINES.on("cpu") == []
    assert runner.kv_cache is None and runner.model is None and runner.sampler is None
    assert probe.released > released  # close handed the cached blocks back


def test_two_engines_at_045_then_a_third_is_refused(probe, model):
    a = LLM(model, gpu_memory_utilization=0.45, **ENGINE)
    b = LLM(model, gpu_memory_utilization=0.45, **ENGINE)
    try:
        assert a.stats["num_kv_blocks"] == b.stats["num_kv_blocks"] > 0
        with pytest.raises(KVCacheMemoryError, match="gpu_memory_utilization=0.45") as err:
            LLM(model, gpu_memory_utilization=0.45, **ENGINE)
        msg = str(err.value)
        assert "2 other engines of this process" in msg
        names = [e.name for e in LIVE_ENGINES.on("cpu")]
        assert len(names) == 2 and all(n in msg for n in names)
        assert "would fit" in msg
        for llm in (a, b):  # both still serve
            assert llm.generate([[3, 4]], use_tqdm=False)[0].outputs[0].token_ids
    finally:
        a.close()
        b.close()
    with LLM(model, gpu_memory_utilization=0.9, **ENGINE) as llm:  # everything came back
        assert llm.stats["num_kv_blocks"] == (int(TOTAL * 0.9) - 3 * MiB) // block_of(llm)


def test_fixed_sizes_ignore_the_share(probe, model):
    with LLM(model, gpu_memory_utilization=0.01, num_kv_blocks=40, **ENGINE) as llm:
        assert llm.stats["num_kv_blocks"] == 40
        (mine,) = LIVE_ENGINES.on("cpu")  # registered all the same
        assert mine.kv_cache == 40 * block_of(llm)


def block_of(llm) -> int:
    return llm.engine.executor.runner.kv_block_bytes()


# ---- on one GPU (marker ``gpu``; skipped without CUDA by tests/engine/conftest.py) ----
# GPU memory you can rebuild and share (issue 23, acceptance 4), on one CUDA device:
# * 10 close-and-rebuild cycles of one checkpoint's engine with different ``max_model_len``, each
#   sized from ``gpu_memory_utilization`` (0.9: ~90% of the device in KV cache every time):
#   ``memory_reserved`` after each close is within 1 GiB of before the first build, and every
#   cycle gives the same tokens.
# * Two ``LLM``s at ``gpu_memory_utilization=0.45`` both serve; a third raises the error that
#   names the setting and the two engines holding the memory; after both close, the memory is
#   back.


GiB = 1 << 30
SP = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 80))]
LENGTHS = [40960, 4096, 40960, 1024, 8192, 40960, 2048, 16384, 32768, 512]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """Qwen3-shaped, 4 layers, max_position_embeddings 40960 like Qwen3-0.6B (fp32 on disk)."""
    return save_tiny_model(
        "qwen3", str(tmp_path_factory.mktemp("mem") / "m"), hidden_size=512,
        intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=40960,
    )  # fmt: skip


def settled_reserved() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


@pytest.mark.gpu
def test_ten_rebuilds_give_the_memory_back(ckpt):
    before = settled_reserved()
    total = torch.cuda.mem_get_info()[1]
    ref = None
    for n in LENGTHS:
        llm = LLM(ckpt, dtype="bfloat16", max_model_len=n)
        device = llm.engine.runtime.device
        kv = llm.engine.executor.runner.kv_cache.nbytes()
        assert kv > 0.7 * total, (n, kv / GiB)  # sized from the share every time
        got = tokens(llm)
        ref = ref or got
        assert got == ref, n
        llm.close()  # the object stays alive: close alone must give the memory back
        held = torch.cuda.memory_reserved() - before
        assert held < GiB, f"max_model_len={n}: {held / GiB:.2f} GiB still reserved after close"
        assert LIVE_ENGINES.on(device) == []


@pytest.mark.gpu
def test_two_engines_at_045_serve_and_a_third_is_refused(ckpt):
    before = settled_reserved()
    total = torch.cuda.mem_get_info()[1]
    a = LLM(ckpt, dtype="bfloat16", gpu_memory_utilization=0.45)
    b = LLM(ckpt, dtype="bfloat16", gpu_memory_utilization=0.45)
    try:
        for llm in (a, b):
            assert llm.engine.executor.runner.kv_cache.nbytes() > 0.35 * total
        assert tokens(a) == tokens(b)
        with pytest.raises(KVCacheMemoryError) as err:
            LLM(ckpt, dtype="bfloat16", gpu_memory_utilization=0.45)
        msg = str(err.value)
        assert "gpu_memory_utilization=0.45" in msg and "2 other engines of this process" in msg
        assert all(e.name in msg for e in LIVE_ENGINES.on(str(a.engine.runtime.device)))
        assert "would fit" in msg or "No gpu_memory_utilization fits" in msg
        assert tokens(a) == tokens(b)  # the refused start left both serving
    finally:
        a.close()
        b.close()
    assert torch.cuda.memory_reserved() - before < GiB
