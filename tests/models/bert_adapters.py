"""The BERT-style attention adapters' tiny models (RoFormer, MegatronBERT, RemBERT, BigBird) and
their stock / paged runs, shared by the CPU and GPU adapter tests.

The coverage test's tiny models leave BERT-style ``LayerNorm`` weights at 0.15 scale, which
makes their greedy tokens collapse onto one id; ``tiny_model`` redraws every ``nn.LayerNorm``
near 1 so the tokens (and the compared per-step scores) depend on the attention being right.
"""

from __future__ import annotations

import warnings

from hf_paged import PagedFallbackWarning
from hf_paged.integration.fallback import reset_fallback_warnings
from hf_paged.testing import build_tiny
from tests.models.coverage_models import BLOCK_SIZE, MAX_NEW_TOKENS, prompts

PAGED = dict(kv_block_size=BLOCK_SIZE, max_model_len=64, num_kv_blocks=64)

# (model_type, config overrides): the defaults, then a variant of each family's options
SERVED = [
    ("roformer", {}),
    ("roformer", {"embedding_size": 32}),  # embeddings projected to hidden
    ("megatron-bert", {}),
    ("megatron-bert", {"num_attention_heads": 8, "hidden_act": "relu"}),
    ("rembert", {}),
    ("rembert", {"input_embedding_size": 32, "output_embedding_size": 48}),
    ("big_bird", {}),  # block_sparse config: the decoder switches to full attention
    ("big_bird", {"attention_type": "original_full", "use_bias": False}),
]


def tiny_model(model_type: str, seed: int = 0, **overrides):
    """A tiny random fp32 causal LM of ``model_type`` (coverage's shrunk config plus
    ``overrides``), LayerNorms near 1, eval mode."""
    return build_tiny(model_type, seed, norms_near_one=True, **overrides)[1]


def generate_with_scores(model, ids, mask, **kw):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS,
        do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True, **kw,
    )  # fmt: skip


def paged_fallbacks(model, **kw) -> tuple[object, list[str]]:
    """``generate(backend="paged")`` on coverage's left-padded prompts; (output, fallback
    warning texts)."""
    from hf_paged import release

    ids, mask = (t.to(model.device) for t in prompts(model.config.get_text_config().vocab_size))
    reset_fallback_warnings()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            out = generate_with_scores(model, ids, mask, backend="paged", paged_config=PAGED, **kw)
    finally:
        release(model)
    return out, [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
