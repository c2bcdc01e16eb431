"""The sampler's input for a step's sampled sequences (``layers.sampler.SamplingMetadata``), read
from the engine's request table."""

from __future__ import annotations

from hf_paged.engine.core.request_state import RequestTable
from hf_paged.engine.core.sequence import Sequence
from hf_paged.layers.sampler import SamplingMetadata


def sampling_metadata(
    requests: RequestTable, seqs: list[Sequence], num_rows: list[int] | None = None
) -> SamplingMetadata:
    """The sampler's view of ``seqs``: one row each, or ``num_rows[i]`` rows for ``seqs[i]``
    (a chunk verifying speculative tokens: row j sees the first j of them as output, so
    penalties and ``min_tokens`` read each position's own history)."""
    num_rows = num_rows or [1] * len(seqs)
    rows = [(s, j) for s, n in zip(seqs, num_rows, strict=True) for j in range(n)]
    params = [s.sampling_params for s, _ in rows]
    # token histories are copied only when some row's penalties or min_tokens read them
    history = any(
        p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
        for p in params
    )
    return SamplingMetadata(
        params=params,
        prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] if history else []
                          for s, _ in rows],
        output_token_ids=[s.output_token_ids + s.spec_token_ids[:j] if history else []
                          for s, j in rows],
        stop_token_ids=[requests.of(s.seq_id).stop_ids for s, _ in rows],
        generators=[requests.generator(s) for s, _ in rows],
    )  # fmt: skip
