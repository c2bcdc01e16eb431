"""Recorders for the generate-integration tests: a logits processor, stopping criteria and a
streamer that keep every call, and lm-evaluation-harness's stop-sequence criterion."""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, StoppingCriteria
from transformers.generation.streamers import BaseStreamer


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


class RecordingStreamer(BaseStreamer):
    def __init__(self):
        self.puts: list[torch.Tensor] = []
        self.ended = 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1
