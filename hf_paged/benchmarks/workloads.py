"""Benchmark workloads (evaluation/README.md, "Workloads"): the request sets that
``evaluation/``'s scripts and ``hf-paged bench`` draw.

* W1 / W2: 256 requests, prompt lengths U[100, 1024], output lengths U[100, 1024], prompt token
  ids U[0, 10000), ``random.Random(0)``: first every prompt (length, then its ids), then every
  output length (nano-vllm's bench.py order). EOS is ignored, decoding is greedy. W1 runs on
  ``qwen3-0.6b``, W2 on ``llama3-8b`` (``random_models.py``); the smoke set on ``tiny``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """A request set: prompt token ids and the number of new tokens each request wants."""

    name: str
    arch: str
    prompts: list[list[int]]
    output_lens: list[int]

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (baselines run on a prefix of the set)."""
        return Workload(self.name, self.arch, self.prompts[:n], self.output_lens[:n])

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_requests(
    num_requests: int = 256,
    prompt_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    vocab_limit: int = 10000,
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """``(prompts, output_lens)``; lengths inclusive on both ends, ids in ``[0, vocab_limit)``."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_limit) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_requests)
    ]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts, output_lens


WORKLOAD_ARCH = {"W1": "qwen3-0.6b", "W2": "llama3-8b"}


def get_workload(name: str, smoke: bool = False) -> Workload:
    """W1 or W2; ``smoke`` = 8 short requests on the tiny model (CPU smoke runs)."""
    if name not in WORKLOAD_ARCH:
        raise ValueError(f"workload={name!r} is not allowed: must be one of {list(WORKLOAD_ARCH)}")
    if smoke:
        prompts, outs = make_requests(8, (4, 32), (4, 16), vocab_limit=500)
        return Workload(name, "tiny", prompts, outs)
    prompts, outs = make_requests()
    return Workload(name, WORKLOAD_ARCH[name], prompts, outs)
