"""GPU memory you can rebuild and share (issue 23, acceptance 4), on one CUDA device.

* 10 close-and-rebuild cycles of one checkpoint's engine with different ``max_model_len``, each
  sized from ``gpu_memory_utilization`` (0.9: ~90% of the device in KV cache every time):
  ``memory_reserved`` after each close is within 1 GiB of before the first build, and every
  cycle gives the same tokens.
* Two ``LLM``s at ``gpu_memory_utilization=0.45`` both serve; a third raises the error that
  names the setting and the two engines holding the memory; after both close, the memory is
  back.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.memory import LIVE_ENGINES, KVCacheMemoryError
from hf_paged.testing import save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

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
