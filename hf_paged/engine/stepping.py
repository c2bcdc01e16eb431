"""One engine step's model run and what its results do to the requests, in both stepping modes.

Synchronous (``run_sync``): run the scheduled step, append the sampled tokens (or the tokens a
chunk with speculative tokens keeps, ``spec/spec_decode.py``), check stops on each, hand
external-sampling rows their logits and pause them. Overlapped (``launch`` + ``apply_resolved``,
``EngineConfig.async_scheduling``): launch the step with placeholders, end what a length limit
ends, then apply the stop checks that need token values to the previous step's tokens once they
reach the host (see ``overlap.py``). The engine owns the state; the stepper reads it through the
engine's parts, returns the sequences to pause, and ends sequences only through
``engine.finish_sequence``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from hf_paged.engine.core.contracts import SchedulerOutput
from hf_paged.engine.core.outputs import RequestOutput
from hf_paged.engine.core.stop import check_stop
from hf_paged.engine.overlap import OverlapStepper, Resolution
from hf_paged.engine.worker.sampling_inputs import sampling_metadata


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)
    # external-sampling requests: (request_id, beam index) -> next-token raw logits [V]
    # float32 on the engine's device (beam 0 for a request that is not a beam search)
    logits: dict = field(default_factory=dict)
    num_generated_tokens: int = 0  # tokens sampled (or handed out as logits) by this step


class Stepper:
    """Runs scheduled steps for one engine (``engine``: its executor, scheduler, block manager,
    request table and paused sequences)."""

    def __init__(self, engine, overlap: OverlapStepper | None, spec):
        self.engine = engine
        self.overlap = overlap
        self.spec = spec  # the engine's SpecDecoder
        self.requests = engine.requests
        self.max_model_len = engine.runtime.max_model_len

    def run_sync(self, out: SchedulerOutput, result: StepResult) -> list:
        """Synchronous step: run, append the sampled (or verified speculative) tokens, check
        stops; returns the external sequences whose logits ``result`` hands out (the engine
        pauses them)."""
        inp, sampled_seqs = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self.requests.prompt_rows(
                seq, chunk.start_pos, len(chunk.token_ids)
            )
        reqs = [self.requests.of(s.seq_id) for s in sampled_seqs]
        counts = [c.num_logits for c in inp.chunks if c.sample]  # logits rows per sampled seq
        starts = list(accumulate(counts, initial=0))[:-1]
        # rows the runner returns raw: external requests', and speculative sampling's
        by_logits = [r.external or self.spec.wants_logits(s, n)
                     for s, r, n in zip(sampled_seqs, reqs, counts)]  # fmt: skip
        external = tuple(
            row for r0, n, raw in zip(starts, counts, by_logits) if raw for row in range(r0, r0 + n)
        )
        internal = [(s, n) for s, n, raw in zip(sampled_seqs, counts, by_logits) if not raw]
        sampling = None
        if internal:
            sampling = sampling_metadata(self.requests, *map(list, zip(*internal)))
        ro = self.engine.executor.run(inp, sampling, external)
        if ro.prompt_logprobs is not None:
            self.requests.record_prompt_logprobs(inp.chunks, ro.prompt_logprobs)
        verified = self.spec.verify(sampled_seqs, starts, counts, ro)  # multi-row chunks
        new: dict[int, object] = {}  # seq_id -> its token, or its kept tokens
        for seq, req, r0 in zip(sampled_seqs, reqs, starts):
            if not req.external:
                got = verified.get(seq.seq_id)
                new[seq.seq_id] = list(got[0]) if got else ro.sampled_token_ids[r0]
        old_lens = [len(s) for s in sampled_seqs]
        handed_out = []
        self.engine.scheduler.update(
            out, [new.get(c.seq_id) if c.sample else None for c in inp.chunks]
        )
        for seq, req, r0, n, old in zip(sampled_seqs, reqs, starts, counts, old_lens):
            if req.external:
                handed_out.append(seq)
                result.logits[(req.request_id, req.seqs.index(seq))] = ro.logits[r0]
                result.num_generated_tokens += 1
                continue
            got = verified.get(seq.seq_id)
            lps = got[1] if got else (ro.logprobs[r0 : r0 + 1] if ro.logprobs else None)
            kept = len(seq) - old
            result.num_generated_tokens += kept
            self.spec.observe(seq, n - 1, max(0, kept - 1))
            self._check_new_tokens(seq, req, old, lps)
        return handed_out

    def _check_new_tokens(self, seq, req, first: int, lps) -> None:
        """The stop rule on each token appended from index ``first`` on, in order: the first
        that stops ``seq`` ends it and the tokens after it are dropped. ``lps``: their
        logprobs (recorded up to the stop) when the request asked for them."""
        record = lps is not None and req.params.logprobs is not None
        for j, end in enumerate(range(first + 1, len(seq) + 1)):
            if record:
                req.logprobs.setdefault(seq.seq_id, []).append(lps[j])
            reason = req.stop_reason(seq, end, self.max_model_len)
            if reason is not None:
                del seq.token_ids[end:]
                self.engine.finish_sequence(seq, reason)
                return

    def launch(self, out: SchedulerOutput, result: StepResult) -> None:
        """Overlapped step: launch ``out``, end what reaches a length limit, then apply the
        tokens of the step launched before it."""
        inp, rows = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self.requests.prompt_rows(
                seq, chunk.start_pos, len(chunk.token_ids)
            )
        sampling = sampling_metadata(self.requests, rows) if rows else None
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
