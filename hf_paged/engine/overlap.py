"""Overlapped stepping (``EngineConfig.async_scheduling``): schedule and launch step n+1 while
the GPU still runs step n, instead of waiting for step n's tokens first.

The scheduler only needs token *counts*, not values, so step n's sampled tokens enter the
sequences as ``PLACEHOLDER`` at launch; step n+1's decode inputs for them are taken on the device
from step n's sampled-token tensor. Right after launching n+1 the stepper waits for n's tokens
(the GPU is busy with n+1 meanwhile), writes them over the placeholders and hands them to the
engine as ``Resolved`` tokens; the engine applies the stop checks that depend on token values
(EOS, stop ids) and registers full blocks in the prefix cache. A sequence that stops there
already has a step n+1 row in flight: its token is dropped and its blocks freed, which is safe
because later steps run after n+1 on the same stream. Length limits are token-independent and the
engine applies them at launch.

The stepper owns the placeholders and the step in flight, and nothing else: it talks to the
executor and the scheduler through their public methods and reports back by return value.

Prompt logprobs ride along: a step's scores start their copy to the host at launch and come
back with its tokens (``Resolution.prompt_logprobs``). Full blocks of a sequence with no
placeholder among its tokens (a prompt still prefilling) are registered in the prefix cache at
launch, so a request waiting for that prefix (``Scheduler._held_back``) can take it in the next
step: later steps read those blocks only after the step computing them, on the same stream.

Only requests whose sampling never reads token values on the host use this path (no penalties,
no sampled-token logprobs, no external sampling) and only with one rank; the engine resolves the
step in flight and steps synchronously whenever another request is present.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.engine.core.contracts import ModelInput, SchedulerOutput
from hf_paged.engine.core.sequence import Sequence

PLACEHOLDER = -1  # a sampled token whose value is still on the device


@dataclass(slots=True)
class Resolved:
    """A placeholder whose value reached the host (already written into ``seq.token_ids``)."""

    seq: Sequence
    pos: int  # index of the token in seq.token_ids
    token_id: int


@dataclass
class Resolution:
    """What reached the host when a step in flight was resolved."""

    tokens: list[Resolved] = field(default_factory=list)
    # (chunks with prompt rows, their PromptScores) of the resolved step, or None
    prompt_logprobs: tuple[list, object] | None = None


@dataclass
class InflightStep:
    """A launched step whose sampled tokens are not yet on the host."""

    rows: list[Sequence]  # sampled sequences, in the runner's row order
    positions: list[int]  # per row: index of its placeholder in seq.token_ids
    pending: object  # model_runner.PendingTokens
    row_of: dict[int, int] = field(default_factory=dict)  # seq_id -> row
    scored_chunks: list = field(default_factory=list)  # chunks with prompt_rows


class OverlapStepper:
    """Holds at most one step in flight and the placeholders of its sequences.

    Args:
        executor: has ``run_async(inp, sampling, prev_pending, prev_rows) -> PendingTokens``.
        scheduler: the engine's Scheduler (its ``update`` advances the sequences at launch).
        profile: a StepProfile (times the wait for tokens).
    """

    def __init__(self, executor, scheduler, profile):
        self.executor = executor
        self.scheduler = scheduler
        self.profile = profile
        self.inflight: InflightStep | None = None
        self.unresolved: dict[int, int] = {}  # seq_id -> placeholders it still has
        self.num_launched = 0  # overlapped steps so far (stats)

    def launch(
        self, out: SchedulerOutput, inp: ModelInput, rows: list[Sequence], sampling
    ) -> Resolution:
        """Run ``out`` (as ``inp``, sampling ``rows``) without waiting; then resolve the step
        launched before it and return what it produced."""
        prev = self.inflight
        # only the newest token of a decode chunk can be a placeholder (from ``prev``)
        prev_rows = [
            prev.row_of[c.seq_id] if c.token_ids[-1] == PLACEHOLDER else -1 for c in inp.chunks
        ]
        pending = self.executor.run_async(inp, sampling, prev.pending if prev else None, prev_rows)
        self.scheduler.update(
            out, [PLACEHOLDER if c.sample else None for c in inp.chunks], cache_blocks=False
        )
        bm = self.scheduler.block_manager
        for seq in out.seqs:  # no placeholder among its computed tokens: its blocks are final
            if not self.unresolved.get(seq.seq_id) and not seq.is_finished:
                bm.cache_full_blocks(seq)
        step = InflightStep(rows, [len(s) - 1 for s in rows], pending)
        step.scored_chunks = [c for c in inp.chunks if c.prompt_rows is not None]
        for i, seq in enumerate(rows):
            step.row_of[seq.seq_id] = i
            self.unresolved[seq.seq_id] = self.unresolved.get(seq.seq_id, 0) + 1
        self.inflight = step
        self.num_launched += 1
        return self._resolve(prev) if prev is not None else Resolution()

    def drain(self) -> Resolution:
        """Resolve the step in flight, if any (before a synchronous step or when idle)."""
        if self.inflight is None:
            return Resolution()
        step, self.inflight = self.inflight, None
        return self._resolve(step)

    def ready(self, seq_id: int) -> bool:
        """No placeholder of this sequence is waiting for its value."""
        return not self.unresolved.get(seq_id)

    def _resolve(self, step: InflightStep) -> Resolution:
        with self.profile.section("wait_gpu"):
            tokens = step.pending.wait()
        scores = step.pending.prompt_scores
        res = Resolution(prompt_logprobs=(step.scored_chunks, scores) if scores else None)
        resolved = res.tokens
        for seq, pos, tok in zip(step.rows, step.positions, tokens):
            left = self.unresolved.pop(seq.seq_id, 1) - 1
            if left:
                self.unresolved[seq.seq_id] = left
            if pos >= len(seq.token_ids):  # truncated: it had stopped one step earlier
                continue
            seq.token_ids[pos] = tok
            resolved.append(Resolved(seq, pos, tok))
        return res
