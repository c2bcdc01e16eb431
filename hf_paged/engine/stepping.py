"""One engine step's model run and what its results do to the requests, in both stepping modes.

Synchronous (``run_sync``): run the scheduled step, append the sampled tokens, check stops, hand
external-sampling rows their logits and pause them. Overlapped (``launch`` + ``apply_resolved``,
``EngineConfig.async_scheduling``): launch the step with placeholders, end what a length limit
ends, then apply the stop checks that need token values to the previous step's tokens once they
reach the host (see ``overlap.py``). The engine owns the state; the stepper reads it through the
engine's parts and changes sequences only through ``engine.finish_sequence`` and
``engine.pause``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.engine.outputs import RequestOutput, SchedulerOutput
from hf_paged.engine.overlap import OverlapStepper, Resolution
from hf_paged.engine.stop import check_stop


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)
    # external-sampling requests: request_id -> next-token raw logits [V] float32 (on the
    # engine's device)
    logits: dict = field(default_factory=dict)
    num_generated_tokens: int = 0  # tokens sampled (or handed out as logits) by this step


class Stepper:
    """Runs scheduled steps for one engine (``engine``: its executor, scheduler, block manager,
    request table and paused sequences)."""

    def __init__(self, engine, overlap: OverlapStepper | None):
        self.engine = engine
        self.overlap = overlap
        self.requests = engine.requests
        self.max_model_len = engine.runtime.max_model_len

    def run_sync(self, out: SchedulerOutput, result: StepResult) -> None:
        """Synchronous step: run, append the sampled tokens, check stops."""
        inp, sampled_seqs = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self.requests.prompt_rows(
                seq, chunk.start_pos, len(chunk.token_ids)
            )
        reqs = [self.requests.of(s.seq_id) for s in sampled_seqs]
        external = tuple(i for i, r in enumerate(reqs) if r.external)
        internal = [s for s, r in zip(sampled_seqs, reqs) if not r.external]
        sampling = self.requests.sampling_metadata(internal) if internal else None
        ro = self.engine.executor.run(inp, sampling, external)
        if ro.prompt_logprobs is not None:
            self.requests.record_prompt_logprobs(inp.chunks, ro.prompt_logprobs)
        ext_ids = {sampled_seqs[i].seq_id for i in external}  # they get logits, not a token
        tokens = iter(ro.sampled_token_ids)
        sampled = []
        for c in inp.chunks:
            tok = next(tokens) if c.sample else None
            sampled.append(None if c.seq_id in ext_ids else tok)
        self.engine.scheduler.update(out, sampled)
        result.num_generated_tokens += len(sampled_seqs)
        for row, (seq, req) in enumerate(zip(sampled_seqs, reqs)):
            if req.external:
                self.engine.pause(seq)
                result.logits[req.request_id] = ro.logits[row]
                continue
            if ro.logprobs is not None and req.params.logprobs is not None:
                req.logprobs.setdefault(seq.seq_id, []).append(ro.logprobs[row])
            reason = req.stop_reason(seq, len(seq), self.max_model_len)
            if reason is not None:
                self.engine.finish_sequence(seq, reason)

    def launch(self, out: SchedulerOutput, result: StepResult) -> None:
        """Overlapped step: launch ``out``, end what reaches a length limit, then apply the
        tokens of the step launched before it."""
        inp, rows = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self.requests.prompt_rows(
                seq, chunk.start_pos, len(chunk.token_ids)
            )
        sampling = self.requests.sampling_metadata(rows) if rows else None
        resolved = self.overlap.launch(out, inp, rows, sampling)
        result.num_generated_tokens += len(rows)
        for seq in rows:  # token values unknown: only the length limits can end it now
            reason = check_stop(
                seq.num_output_tokens, None, len(seq), seq.sampling_params, (),
                self.max_model_len,
            )  # fmt: skip
            if reason is not None:
                self.engine.finish_sequence(seq, reason)  # its token arrives with the resolution
        self.apply_resolved(resolved)

    def apply_resolved(self, resolved: Resolution) -> None:
        """Prompt logprobs and stop checks on what just reached the host (overlapped
        stepping)."""
        if resolved.prompt_logprobs is not None:
            chunks, scores = resolved.prompt_logprobs
            self.requests.record_prompt_logprobs(chunks, scores.entries())
        for r in resolved.tokens:
            seq = r.seq
            req = self.requests.of(seq.seq_id)
            stopped = "stop" == req.stop_reason(seq, r.pos + 1, self.max_model_len)
            if seq.is_finished:  # by a length limit at launch, or aborted
                if stopped:
                    del seq.token_ids[r.pos + 1 :]  # drop tokens launched after the stop
                    if seq.finish_reason == "length":
                        seq.finish_reason = "stop"  # as the synchronous path reports it
                self.requests.mark_finished(seq)
                continue
            self.engine.block_manager.cache_full_blocks(seq)
            if stopped:
                del seq.token_ids[r.pos + 1 :]  # drop the token of the step still in flight
                self.engine.finish_sequence(seq, "stop")
