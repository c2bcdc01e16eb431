"""The parity oracles: stock HF against the engine.

- ``hf_greedy`` / ``paged_greedy``: stock ``generate`` one prompt at a time and ``LLM`` on the
  same prompts, both for exactly ``new_tokens`` greedy tokens (EOS never stops either);
- ``stock_and_paged``: one ``generate`` call run stock and with ``backend="paged"``.
"""

from __future__ import annotations

import warnings

import torch

NEW_TOKENS = 32
MAX_MODEL_LEN = 128
# small enough to build fast, large enough for the integration tests' batches; 32 tokens per
# step forces chunked prefill of the longer prompts
SMALL_ENGINE = dict(
    num_kv_blocks=128, kv_block_size=4, max_num_batched_tokens=32, max_num_seqs=8, seed=0
)


def hf_greedy(hf, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Stock greedy ``generate`` of each prompt alone (no padding) on ``hf``'s device; the new
    token ids of each."""
    outs = []
    for p in prompts:
        ids = torch.tensor([p], device=hf.device)
        with torch.no_grad():
            seq = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
            )  # fmt: skip
        outs.append(seq[0, len(p) :].tolist())
    return outs


def paged_greedy(model, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, **engine_kwargs):
    """``LLM(model).generate`` greedy for exactly ``new_tokens`` tokens per prompt.

    Args:
        model: a checkpoint directory or an in-memory HF model.
        engine_kwargs: override the defaults (``max_model_len=MAX_MODEL_LEN``, KV blocks of 8,
            256 of them).

    Returns:
        ``(token ids per prompt, the engine's stats after the call)``; asserts that every
        request ran its full length and every KV block came back.
    """
    from hf_paged.config import SamplingParams
    from hf_paged.entrypoints.llm import LLM

    # min_tokens masks EOS like HF min_new_tokens, so both run the full new_tokens
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, min_tokens=new_tokens)
    kwargs = dict(max_model_len=MAX_MODEL_LEN, kv_block_size=8, num_kv_blocks=256)
    kwargs.update(engine_kwargs)
    with LLM(model, **kwargs) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        stats = dict(llm.stats)
    assert all(o.finish_reason == "length" and len(o.token_ids) == new_tokens for o in outs)
    assert stats["num_free_blocks"] == stats["num_kv_blocks"]  # every block back
    return [o.token_ids for o in outs], stats


def fallback_warnings(records) -> list[str]:
    """The messages of the ``PagedFallbackWarning`` among recorded warnings."""
    from hf_paged.integration.fallback import PagedFallbackWarning

    return [str(w.message) for w in records if issubclass(w.category, PagedFallbackWarning)]


def stock_and_paged(model, fresh=None, expect_fallback: bool = False, **kwargs):
    """Run ``model.generate(**kwargs)`` stock and with ``backend="paged"``.

    Args:
        fresh: a callable returning per-call keyword arguments with state (criteria, processors,
            streamers), called once per run; its two results are returned too.
        expect_fallback: when False, a PagedFallbackWarning fails the test.

    Returns:
        ``(stock_out, paged_out, stock_extra, paged_extra, fallback_messages)``.
    """
    stock_extra = fresh() if fresh else {}
    paged_extra = fresh() if fresh else {}
    torch.manual_seed(1234)
    stock = model.generate(**kwargs, **stock_extra)
    torch.manual_seed(1234)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        paged = model.generate(**kwargs, **paged_extra, backend="paged")
    msgs = fallback_warnings(records)
    if not expect_fallback:
        assert not msgs, msgs
    return stock, paged, stock_extra, paged_extra, msgs
