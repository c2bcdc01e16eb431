"""Overlapped stepping (``EngineConfig.async_scheduling``): schedule and launch step n+1 while
the GPU still runs step n, instead of waiting for step n's tokens first.

The scheduler only needs token *counts*, not values, so step n's sampled tokens enter the
sequences as ``PLACEHOLDER`` at launch; step n+1's decode inputs for them are taken on the device
from step n's sampled-token tensor. Right after launching n+1 the engine waits for n's tokens
(the GPU is busy with n+1 meanwhile), writes them over the placeholders, registers the blocks
that became full in the prefix cache, and applies the stop checks that depend on token values
(EOS, stop ids). A sequence that stops there already has a step n+1 row in flight: its token is
dropped and its blocks freed, which is safe because later steps run after n+1 on the same stream.
Length limits are token-independent and end a sequence at launch.

Only requests whose sampling never reads token values on the host use this path (no penalties,
no logprobs, no external sampling) and only with one rank; the engine resolves the step in
flight and steps synchronously whenever another request is present.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.config import SamplingParams
from hf_paged.engine.outputs import ModelInput, ScheduledChunk, SchedulerOutput
from hf_paged.engine.sequence import Sequence

PLACEHOLDER = -1  # a sampled token whose value is still on the device


def overlap_eligible(params: SamplingParams, external: bool) -> bool:
    """Whether a request's sampling can run without its token values on the host."""
    return (
        not external
        and params.logprobs is None
        and params.prompt_logprobs is None
        and params.repetition_penalty == 1.0
        and (params.presence_penalty == 0.0 and params.frequency_penalty == 0.0)
    )


@dataclass
class InflightStep:
    """A launched step whose sampled tokens are not yet on the host."""

    rows: list[Sequence]  # sampled sequences, in the runner's row order
    positions: list[int]  # per row: index of its placeholder in seq.token_ids
    pending: object  # model_runner.PendingTokens
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> row


class OverlapStepper:
    """The engine's overlapped path; holds at most one step in flight."""

    def __init__(self, engine):
        self.engine = engine
        self.inflight: InflightStep | None = None
        self.unresolved: dict[int, int] = {}  # seq_id -> placeholders it still has
        self.num_launched = 0  # overlapped steps so far (stats)

    def launch(self, out: SchedulerOutput) -> None:
        """Run ``out`` without waiting; then resolve the step launched before it."""
        eng = self.engine
        prev = self.inflight
        chunks, rows, prev_rows = [], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            tokens = seq.token_ids[start : start + n]
            sample = start + n == len(seq)
            chunks.append(ScheduledChunk(seq.seq_id, tokens, start, seq.block_table, sample))
            # only the newest token of a decode chunk can be a placeholder (from ``prev``)
            prev_rows.append(prev.row_of[seq.seq_id] if tokens[-1] == PLACEHOLDER else -1)
            if sample:
                rows.append(seq)
        sampling = eng._sampling_metadata(rows) if rows else None
        pending = eng.executor.run_async(
            ModelInput(chunks), sampling, prev.pending if prev else None, prev_rows
        )
        eng.scheduler.update(
            out, [PLACEHOLDER if c.sample else None for c in chunks], cache_blocks=False
        )
        step = InflightStep(rows, [len(s) - 1 for s in rows], pending)
        for i, seq in enumerate(rows):
            step.row_of[seq.seq_id] = i
            self.unresolved[seq.seq_id] = self.unresolved.get(seq.seq_id, 0) + 1
            params = seq.sampling_params
            if seq.num_output_tokens >= params.max_tokens or len(seq) >= eng.runtime.max_model_len:
                eng._finish(seq, "length")  # its token arrives with the resolution
        self.inflight = step
        self.num_launched += 1
        if prev is not None:
            self._resolve(prev)

    def drain(self) -> None:
        """Resolve the step in flight, if any (before a synchronous step or when idle)."""
        if self.inflight is not None:
            step, self.inflight = self.inflight, None
            self._resolve(step)

    def ready(self, seq_id: int) -> bool:
        """No placeholder of this sequence is waiting for its value."""
        return not self.unresolved.get(seq_id)

    def _resolve(self, step: InflightStep) -> None:
        eng = self.engine
        if step is self.inflight:
            self.inflight = None
        with eng.profile.section("wait_gpu"):
            tokens = step.pending.wait()
        for seq, pos, tok in zip(step.rows, step.positions, tokens):
            left = self.unresolved.pop(seq.seq_id, 1) - 1
            if left:
                self.unresolved[seq.seq_id] = left
            if pos >= len(seq.token_ids):  # truncated: it had stopped one step earlier
                continue
            seq.token_ids[pos] = tok
            params = seq.sampling_params
            stopped = pos + 1 - seq.num_prompt_tokens >= params.min_tokens and (
                tok in eng.stop_ids(seq)
            )
            if seq.is_finished:
                if stopped and seq.finish_reason == "length" and pos == len(seq) - 1:
                    seq.finish_reason = "stop"  # as the synchronous path would report it
                eng._maybe_done.add(seq.seq_id)
                continue
            eng.block_manager.cache_full_blocks(seq)
            if stopped:
                del seq.token_ids[pos + 1 :]  # drop the token of the step still in flight
                eng._finish(seq, "stop")
