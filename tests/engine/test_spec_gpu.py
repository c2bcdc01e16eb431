"""Speculative decoding on one GPU: the verification chunks run through the Triton prefill kernel
(blocks of 16) next to CUDA-graph decodes of plain requests in the same engine; fp32 greedy is
stock's greedy (prompt lookup and a draft engine on the same GPU, also with preemption), and
bf16 speculative greedy matches the engine's own bf16 greedy but for rare near-ties."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_paged import LLM, DraftModelProposer, NgramProposer, SamplingParams
from hf_paged.testing import save_tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

NEW = 32
ENGINE = dict(max_model_len=256, kv_block_size=16, num_kv_blocks=256, max_num_seqs=16)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        motif = [rng.randrange(3, 256) for _ in range(rng.randint(3, 9))]
        out.append((motif * 4)[: 10 + 5 * i])
    return out


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_gpu")
    target = save_tiny_model("llama", str(root / "target"), seed=0)
    draft = save_tiny_model("llama", str(root / "draft"), seed=0, num_hidden_layers=1)
    return target, draft


def stock(path, batch) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    out = []
    for p in batch:
        ids = torch.tensor([p], device="cuda")
        seq = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                          min_new_tokens=NEW, do_sample=False, pad_token_id=0)  # fmt: skip
        out.append(seq[0, len(p) :].tolist())
    return out


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)


@pytest.mark.parametrize("num_kv_blocks", [256, 24])  # 24: preemption
def test_fp32_speculative_greedy_is_stock_greedy(paths, num_kv_blocks):
    target, draft = paths
    batch = prompts(8, seed=num_kv_blocks)
    ref = stock(target, batch)
    cfg = dict(ENGINE, dtype="float32", num_kv_blocks=num_kv_blocks)
    with LLM(target, **cfg) as llm, LLM(draft, **dict(cfg, num_kv_blocks=256)) as d:
        assert llm.engine.executor.runner.attn_backend.name == "triton"
        for proposer in (NgramProposer(8, backoff=False), DraftModelProposer(d, 6)):
            outs = llm.generate(batch, greedy(), use_tqdm=False, proposer=proposer)
            assert [o.token_ids for o in outs] == ref
        assert llm.stats["spec_num_accepted_tokens"] > 0
        assert llm.stats["num_free_blocks"] == llm.stats["num_kv_blocks"]
        if num_kv_blocks == 24:
            assert llm.stats["num_preemptions"] > 0


def test_spec_and_plain_requests_share_steps(paths):
    """Requests with and without a proposer in one engine run (the plain ones decode in the
    same synchronous steps); both kinds give their plain greedy tokens."""
    target, _ = paths
    batch = prompts(12, seed=3)
    with LLM(target, **dict(ENGINE, dtype="float32")) as llm:
        plain = [o.token_ids for o in llm.generate(batch, greedy(), use_tqdm=False)]
        eng, prop = llm.engine, NgramProposer(8, backoff=False)
        rids = [eng.add_request(p, greedy(), proposer=prop if i % 2 else None)
                for i, p in enumerate(batch)]  # fmt: skip
        done = {}
        while eng.has_unfinished_requests():
            done.update((o.request_id, o.token_ids) for o in eng.step().finished)
        assert [done[r] for r in rids] == plain


def test_bf16_speculative_greedy_matches_the_engines_greedy(paths):
    target, _ = paths
    batch = prompts(16, seed=4)
    with LLM(target, **dict(ENGINE, dtype="bfloat16")) as llm:
        plain = [o.token_ids for o in llm.generate(batch, greedy(), use_tqdm=False)]
        spec = llm.generate(batch, greedy(), use_tqdm=False, proposer=NgramProposer(8))
    same = sum(a == b.token_ids for a, b in zip(plain, spec))
    assert same >= len(batch) - 2, f"only {same}/{len(batch)} identical"
