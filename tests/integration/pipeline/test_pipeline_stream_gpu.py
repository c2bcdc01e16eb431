"""A paged pipeline over a list on one GPU (CUDA graphs, Triton backend): fp32 greedy outputs
equal the stock pipeline's, and the prompts ran concurrently in one engine run."""

from __future__ import annotations

import pytest
import torch
import transformers

import hf_paged  # noqa: F401  (installs the dispatcher and the pipeline wrapper)
from hf_paged.testing import save_checkpoint

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

PROMPTS = [f"{w} {i}" for i, w in enumerate(["Hello, my name is", "ab", "def fib(n):"] * 16)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(str(tmp_path_factory.mktemp("pipe_gpu")), family="qwen3")


@pytest.mark.parametrize("batch_size", [1, 8])
def test_pipeline_list_equals_stock_on_cuda(ckpt, batch_size):
    kw = dict(max_new_tokens=16, do_sample=False, batch_size=batch_size)
    stock = transformers.pipeline("text-generation", model=ckpt, device="cuda", dtype=torch.float32)
    want = stock(PROMPTS, **kw)
    del stock
    pipe = transformers.pipeline(
        "text-generation", model=ckpt, backend="paged", device="cuda", dtype=torch.float32,
        paged_config={"max_num_seqs": 32},
    )  # fmt: skip
    try:
        assert pipe(PROMPTS, **kw) == want
        stats = pipe.model.engine.stats
        assert stats["max_num_running_seqs"] > batch_size
        assert stats["num_free_blocks"] == stats["num_kv_blocks"]
    finally:
        pipe.model.close()
