"""Requests with bidirectional ranges on the engine: a tiny Gemma 3 text decoder (sliding and
full layers, window shorter than the ranges) gives the greedy tokens of stock's own Gemma 3 image
masks, with the whole prompts in one step, in cramped chunks smaller than a range, and with the
ranges' blocks taken from the prefix cache.

Stock's oracle recomputes the whole sequence each step under the masks
``create_masks_for_vision_model`` builds from block ids (one block per range; generated tokens
are text): the tokens ``generate(token_type_ids=...)`` of a Gemma 3 model gives, whose mask is
applied at prefill only. (Back-to-back ranges are two blocks here; ``token_type_ids`` would make
them one, as ``ranges_from_token_types`` does.)
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_paged import LLM, SamplingParams, attention
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.engine.core.request import EngineRequest
from hf_paged.testing.models import randomize_

MAX_NEW = 6
# (prompt length, ranges): an image-like range longer than the window (4) and the chunk budget,
# ranges on block edges (blocks of 4), back to back ranges, and a prompt with none
PROMPTS = [
    (21, [(3, 14)]),
    (18, [(4, 8), (8, 16)]),
    (13, []),
    (25, [(1, 2), (9, 24)]),
]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(0)
    model = randomize_(Gemma3ForCausalLM(config).eval(), seed=0)
    with torch.no_grad():  # Gemma scales embeddings by sqrt(hidden) and norms by (1 + w):
        model.model.embed_tokens.weight.mul_(0.02)  # smaller rows and norm weights near 0
        for name, p in model.named_parameters():  # keep the attention (and so the mask) in play
            if "norm" in name:
                p.copy_(0.5 * torch.randn(p.shape))
    path = tmp_path_factory.mktemp("gemma3_bidir")
    model.save_pretrained(path)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(3, 256, (n,), generator=g).tolist(), r) for n, r in PROMPTS]


def _stock_greedy(model, ids: list[int], ranges, max_new: int) -> list[int]:
    from transformers.models.gemma3.modeling_gemma3 import create_masks_for_vision_model

    seq = list(ids)
    for _ in range(max_new):
        groups = torch.full((1, len(seq)), -1)  # stock's block ids: one per range, -1 = text
        for k, (a, b) in enumerate(ranges):
            groups[0, a:b] = k
        x = torch.tensor([seq])
        masks = create_masks_for_vision_model(
            config=model.config, inputs_embeds=model.model.embed_tokens(x),
            attention_mask=torch.ones_like(x), cache=None,
            position_ids=torch.arange(len(seq))[None],
            block_sequence_ids=groups,
        )  # fmt: skip
        logits = model(input_ids=x, attention_mask=masks, use_cache=False).logits
        seq.append(int(logits[0, -1].argmax()))
    return seq[len(ids) :]


@pytest.fixture(scope="module")
def stock(model_path):
    from transformers import Gemma3ForCausalLM

    model = Gemma3ForCausalLM.from_pretrained(model_path, attn_implementation="sdpa").eval()
    with torch.no_grad():
        bidir = [_stock_greedy(model, ids, r, MAX_NEW) for ids, r in _prompts()]
        causal = [_stock_greedy(model, ids, [], MAX_NEW) for ids, r in _prompts()]
    return bidir, causal


def _engine_tokens(llm: LLM, with_ranges: bool = True) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    reqs = [EngineRequest(ids, params, bidirectional_ranges=r if with_ranges else None)
            for ids, r in _prompts()]  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in llm.engine.run(reqs)]


def test_the_ranges_change_stocks_tokens(stock):
    """The oracle is sensitive: the same prompts without the ranges give other tokens."""
    bidir, causal = stock
    assert [b != c for b, c in zip(bidir, causal)] == [True, True, False, True]


@pytest.mark.parametrize(
    "engine_kwargs",
    [
        dict(max_num_batched_tokens=128),  # every prompt in one step
        dict(max_num_batched_tokens=3),  # chunks of 3: ranges of 11 and 15 go whole
        dict(max_num_batched_tokens=5, max_num_seqs=1),  # one sequence at a time
    ],
    ids=["one_step", "cramped", "one_by_one"],
)
def test_engine_equals_stock_masks(model_path, stock, engine_kwargs):
    with LLM(model_path, kv_block_size=4, max_model_len=64, **engine_kwargs) as llm:
        bm = llm.engine.block_manager
        assert _engine_tokens(llm) == stock[0]
        # again on the same engine: the prompts' blocks now come from the prefix cache
        hits = bm.num_prefix_hit_tokens
        assert _engine_tokens(llm) == stock[0]
        assert bm.num_prefix_hit_tokens - hits >= 4 * 12  # the blocks before each last token
        # the same ids without ranges hold other KV: no block with a range is shared
        assert _engine_tokens(llm, with_ranges=False) == stock[1]


def test_bad_ranges_are_named(model_path):
    with LLM(model_path, kv_block_size=4, max_model_len=64) as llm:
        params = SamplingParams(max_tokens=2)
        for bad in ([(3, 30)], [(5, 3)], [(0, 4), (2, 6)], [("a", 2)]):
            with pytest.raises(ValueError, match=r"bidirectional_ranges=.* is not allowed"):
                llm.engine.add_request(
                    EngineRequest(list(range(3, 23)), params, bidirectional_ranges=bad)
                )
        assert not llm.engine.has_unfinished_requests()


class CausalOnlyBackend(TorchRefBackend):
    """A backend that cannot take bidirectional ranges (it drops them): its layers must hand a
    step with ranges to the torch reference."""

    accepts_bidirectional = False

    def forward(self, q, k, v, k_cache, v_cache, meta, spec, kv_stored=False, sinks=None):
        meta = dataclasses.replace(meta, bidirectional_ranges=None, query_key_ends=None)
        return super().forward(q, k, v, k_cache, v_cache, meta, spec, kv_stored, sinks)


def test_a_backend_without_ranges_hands_them_to_the_reference(model_path, stock, monkeypatch):
    monkeypatch.setitem(attention._REGISTRY, "causal_only",
                        f"{__name__}:CausalOnlyBackend")  # fmt: skip
    with LLM(model_path, kv_block_size=4, max_model_len=64, max_num_batched_tokens=3,
             attention_backend="causal_only") as llm:  # fmt: skip
        assert _engine_tokens(llm) == stock[0]
