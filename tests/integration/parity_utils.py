"""Helpers for the generate-integration tests: prompts, a 256-token tokenizer, recorders, and
``stock_and_paged`` which runs one call both ways and returns the outputs and warnings."""

from __future__ import annotations

import random
import warnings

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer

from hf_paged import PagedFallbackWarning
from hf_paged.testing import build_char_tokenizer

PAD = 0  # tiny_config: pad 0, bos 1, eos 2, vocab 256
# small enough to build fast, large enough for every batch in these tests; 32 tokens per step
# forces chunked prefill of the longer prompts on the real engine
SMALL_ENGINE = dict(
    num_kv_blocks=128, kv_block_size=4, max_num_batched_tokens=32, max_num_seqs=8, seed=0
)


def make_prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def left_pad(prompts, pad: int = PAD):
    """``(input_ids [B, L], attention_mask [B, L])`` with pads on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def right_pad(prompts, pad: int = PAD):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    return ids, mask


def build_tokenizer():
    """The char tokenizer padded to the tiny models' 256 ids (every emitted id decodes)."""
    return build_char_tokenizer(256)


class RecordingProcessor(LogitsProcessor):
    """Records every call's ``(input_ids, scores)`` and nudges one token so its effect shows."""

    def __init__(self, boost_token: int = 7, boost: float = 3.0):
        self.calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.boost_token, self.boost = boost_token, boost

    def __call__(self, input_ids, scores):
        self.calls.append((input_ids.clone(), scores.clone()))
        scores = scores.clone()
        scores[:, self.boost_token] += self.boost
        return scores


class RecordingCriteria(StoppingCriteria):
    """Records every call and stops a row once its last token is ``% modulus == 0`` (rows stop
    at different steps)."""

    def __init__(self, modulus: int = 5):
        self.calls: list[tuple[torch.Tensor, object]] = []
        self.modulus = modulus

    def __call__(self, input_ids, scores, **kwargs):
        self.calls.append((input_ids.clone(), None if scores is None else len(scores)))
        return input_ids[:, -1] % self.modulus == 0


class MultiTokenEOSCriteria(StoppingCriteria):
    """lm-evaluation-harness's stop-sequence criterion (batch-level bool, decodes a lookback)."""

    def __init__(self, sequence: str, tokenizer, initial_decoder_input_length: int, batch: int):
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch
        self.sequence = sequence
        self.sequence_ids = tokenizer.encode(sequence, add_special_tokens=False)
        self.sequence_id_len = len(self.sequence_ids) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        lookback = input_ids[:, self.initial_decoder_input_length :][:, -self.sequence_id_len :]
        texts = self.tokenizer.batch_decode(lookback)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in texts[i]
        return False not in self.done_tracker


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


def fallback_warnings(records) -> list[str]:
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
