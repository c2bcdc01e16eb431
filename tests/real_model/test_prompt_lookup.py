"""Prompt-lookup decoding on copy-heavy text (the model asked to repeat a paragraph) gives the
demo model's greedy tokens in fewer forward passes: the engine's n-gram proposals from the
prompt are verified several tokens per pass. Passes are counted at the engine's model runner."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from hf_paged.testing.chat_prompts import COPY_QUESTION, chat_ids

pytestmark = pytest.mark.real_model

NEW = 64


def test_prompt_lookup_gives_stocks_tokens_in_fewer_passes(stock_fp32, demo_tokenizer):
    from hf_paged.integration.dispatch import get_engine

    ids = torch.tensor(chat_ids(demo_tokenizer, [COPY_QUESTION]))
    want = stock_fp32.generate(ids, max_new_tokens=NEW, do_sample=False)
    assert want.shape[1] - ids.shape[1] == NEW  # the copy runs to the token limit
    plain = stock_fp32.generate(ids, max_new_tokens=4, do_sample=False, backend="paged")
    assert torch.equal(plain, want[:, : ids.shape[1] + 4])  # the engine is built
    runner = get_engine(stock_fp32).executor.runner
    with mock.patch.object(runner, "run_model", wraps=runner.run_model) as passes:
        got = stock_fp32.generate(ids, max_new_tokens=NEW, do_sample=False, backend="paged",
                                  prompt_lookup_num_tokens=10)  # fmt: skip
    assert torch.equal(got, want)
    # without proposals: one prefill pass and one pass per further token (NEW in all)
    assert passes.call_count <= NEW // 3, passes.call_count
