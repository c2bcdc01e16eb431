"""Attention adapters of RoFormer, MegatronBERT, RemBERT and BigBird (``adapters/``) against
stock greedy, and the precise refusals (bidirectional decoders, RoFormer's rotary values, XLM,
TrOCR, CPM-Ant, Doge, tensor parallelism).

The models come from ``bert_adapters.tiny_model`` (LayerNorms near 1, so the tokens and the
compared per-step scores depend on the attention being right).
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from hf_paged import LLM, SamplingParams
from hf_paged.models.generic.support import UnsupportedModelError
from hf_paged.testing import hf_greedy, parity
from tests.models.bert_adapters import SERVED, generate_with_scores, paged_fallbacks, tiny_model
from tests.models.coverage_models import BLOCK_SIZE, prompts


@pytest.mark.parametrize(("model_type", "overrides"), SERVED)
def test_left_padded_parity(model_type, overrides):
    """Prompts of 1, 4, 5, 9 tokens left padded, KV blocks of 4, 16 greedy tokens: the tokens
    and every step's scores equal stock's."""
    model = tiny_model(model_type, **overrides)
    ids, mask = prompts(model.config.vocab_size)
    with torch.no_grad():
        ref = generate_with_scores(model, ids, mask)
    new = ref.sequences[:, ids.shape[1] :]
    assert len(set(new.flatten().tolist())) >= 5, new  # the oracle is not a constant
    out, fell = paged_fallbacks(model)
    assert fell == []
    assert torch.equal(out.sequences, ref.sequences)
    torch.testing.assert_close(torch.stack(out.scores), torch.stack(ref.scores), rtol=1e-4,
                               atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("model_type", ["roformer", "big_bird"])
def test_prefix_cache_chunked_prefill(model_type, tmp_path):
    """From a checkpoint: a shared prefix served from the prefix cache, then prefill chunks of
    5 tokens, each equal to stock greedy on the unpadded prompts."""
    model = tiny_model(model_type, seed=1)
    model.save_pretrained(tmp_path)
    rng = random.Random(0)
    shared = [rng.randrange(3, model.config.vocab_size) for _ in range(10)]
    batch = [shared + [rng.randrange(3, model.config.vocab_size) for _ in range(n)]
             for n in (1, 3, 6, 11)]  # fmt: skip
    ref = parity.hf_greedy(model, batch)
    engine = dict(max_model_len=64, kv_block_size=BLOCK_SIZE)
    got, stats = parity.paged_greedy(str(tmp_path), batch, enable_prefix_caching=True,
                                     max_num_seqs=2, **engine)  # fmt: skip
    assert stats["prefix_cache_hit_tokens"] > 0
    assert got == ref
    got, _ = parity.paged_greedy(str(tmp_path), batch, max_num_batched_tokens=5, **engine)
    assert got == ref


@pytest.mark.parametrize(
    ("model_type", "overrides", "expect"),
    [
        ("roformer", {"is_decoder": False}, "is_decoder=False"),
        ("megatron-bert", {"is_decoder": False}, "is_decoder=False"),
        ("big_bird", {"is_decoder": False}, "is_decoder=False"),
        ("roformer", {"rotary_value": True}, "rotary_value=True"),
        ("trocr", {}, "numbers positions over the padded row"),
        ("xlm", {}, "appending a mask token"),
        ("cpmant", {}, "relative-position bucket"),
        ("doge", {}, "per-key bias computed from the values"),
    ],
)
def test_refusals_name_their_reason(model_type, overrides, expect):
    """What the engine cannot reproduce runs stock, with a fallback warning saying why."""
    model = tiny_model(model_type, **overrides)
    if "is_decoder" in overrides:  # shrink_config sets is_decoder=True for causal heads
        model.config.is_decoder = False
        for m in model.modules():
            if hasattr(m, "is_decoder"):
                m.is_decoder = False
    ids, mask = prompts(model.config.get_text_config().vocab_size)
    with torch.no_grad():
        ref = generate_with_scores(model, ids, mask)
    out, fell = paged_fallbacks(model)
    assert len(fell) == 1 and expect in fell[0], fell
    assert torch.equal(out.sequences, ref.sequences)


def test_roformer_table_not_sinusoid_refused():
    """A RoFormer checkpoint whose position table is not the sinusoid: rotary is then not
    relative, stock's tokens depend on the padding, and the engine refuses it by name."""
    model = tiny_model("roformer")
    with torch.no_grad():
        table = model.roformer.encoder.embed_positions.weight
        table.add_(0.1 * torch.randn(table.shape, generator=torch.Generator().manual_seed(0)))
    _, fell = paged_fallbacks(model)
    assert len(fell) == 1 and "not the sinusoid" in fell[0], fell


def test_bidirectional_decoder_is_detected():
    """A base model whose forward builds no causal mask (transformers 5.17's RoFormer,
    MegatronBERT, RemBERT, BigBird) is named; today's classes pass."""
    from transformers import BigBirdModel, MegatronBertModel, RemBertModel, RoFormerModel

    from hf_paged.models.generic.adapters._bert_style import bidirectional_refusal

    class Bidirectional(nn.Module):
        def forward(self, x):
            return create_bidirectional_mask(x)  # noqa: F821  (source only, never run)

    for cls in (RoFormerModel, MegatronBertModel, RemBertModel, BigBirdModel):
        assert bidirectional_refusal(cls) is None, cls
    reason = bidirectional_refusal(Bidirectional)
    assert reason is not None and "bidirectional attention mask for decoders" in reason.detail


@pytest.mark.parametrize("model_type", ["roformer", "megatron-bert", "rembert", "big_bird"])
def test_tensor_parallel_refused(model_type):
    """No TP plan in these configs: tp_size=2 is refused by name before anything is sharded."""
    from hf_paged.attention.torch_ref import TorchRefBackend
    from hf_paged.distributed.communicator import Communicator
    from hf_paged.layers.context import ModelContext
    from hf_paged.models.generic.model import GenericForCausalLM

    config = tiny_model(model_type).config
    ctx = ModelContext(TorchRefBackend(), comm=Communicator(0, 2, group=object()))
    with pytest.raises(UnsupportedModelError, match="has no tensor-parallel plan"):
        GenericForCausalLM(config, ctx, torch.float32, "cpu")


# ---- on one GPU (marker gpu, skipped without CUDA) ----------------------------------------------
# RoFormer / MegatronBERT / RemBERT / BigBird adapters on one GPU: fp32 left-padded greedy
# parity with stock (Triton backend, decode CUDA graphs), or, on a transformers whose base model
# builds a bidirectional mask for decoders, the named fallback with stock's tokens.


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _reason(model) -> str | None:
    from hf_paged.models.generic.adapters._bert_style import bidirectional_refusal

    refusal = bidirectional_refusal(type(model.base_model))
    return None if refusal is None else refusal.detail


@pytest.mark.gpu
@needs_cuda
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


@pytest.mark.gpu
@needs_cuda
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
