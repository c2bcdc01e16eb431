"""RoFormer / MegatronBERT / RemBERT / BigBird adapters on one GPU: fp32 left-padded greedy
parity with stock (Triton backend, decode CUDA graphs), or, on a transformers whose base model
builds a bidirectional mask for decoders, the named fallback with stock's tokens."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing import hf_greedy
from tests.models.bert_adapters import SERVED, generate_with_scores, paged_fallbacks, tiny_model

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)


def _reason(model) -> str | None:
    from hf_paged.models.generic.adapters._bert_style import bidirectional_reason

    refusal = bidirectional_reason(type(model.base_model))
    return None if refusal is None else refusal.detail


@pytest.mark.parametrize(("model_type", "overrides"), SERVED)
def test_left_padded_parity_cuda(model_type, overrides):
    from tests.models.coverage_models import prompts

    model = tiny_model(model_type, **overrides).cuda()
    ids, mask = (t.cuda() for t in prompts(model.config.vocab_size))
    with torch.no_grad():
        ref = generate_with_scores(model, ids, mask)
    out, fell = paged_fallbacks(model)
    assert torch.equal(out.sequences, ref.sequences)
    reason = _reason(model)
    if reason is not None:  # this transformers' "causal" LM attends to later prompt tokens
        assert len(fell) == 1 and reason in fell[0], fell
        return
    assert fell == []
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-3,
                               atol=1e-3)  # fmt: skip


@pytest.mark.parametrize("model_type", ["roformer", "big_bird"])
def test_cuda_graph_decode(model_type):
    """Decode replays CUDA graphs (the probe allows them) and the tokens equal stock's."""
    model = tiny_model(model_type, seed=2).cuda()
    if _reason(model) is not None:
        pytest.skip(_reason(model))
    prompts = [[5, 6, 7], [9] * 17, list(range(3, 40))]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    with LLM(model, max_model_len=128, kv_block_size=16, num_kv_blocks=64) as llm:
        runner = llm.engine.executor.runner
        assert runner.model.supports_cuda_graph, runner.model.cuda_graph_reason
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == hf_greedy(model, prompts, new_tokens=24)
