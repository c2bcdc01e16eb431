"""One engine step's model run, in both stepping modes: the stepper moves tokens, the engine
applies the stop rule to what it reports.

Synchronous (``run_sync``): run the scheduled step, append the sampled tokens (or the tokens a
chunk with speculative tokens keeps, ``spec/spec_decode.py``) and hand external-sampling rows
their logits. Overlapped (``launch`` + ``resolved``, ``EngineConfig.async_scheduling``): launch
the step with placeholders, then take the previous step's tokens once they reach the host (see
``overlap.py``). Each returns ``TakenTokens`` (what it appended), which the engine applies the
stop rule to, in order (``Postprocessor.take``); the stepper itself ends nothing and pauses
nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate

from hf_paged.engine.core.contracts import SchedulerOutput, TakenTokens
from hf_paged.engine.core.outputs import RequestOutput
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
    """Runs scheduled steps for one engine (``engine``: its executor, scheduler and request
    table)."""

    def __init__(self, engine, overlap: OverlapStepper | None, spec):
        self.engine = engine
        self.overlap = overlap
        self.spec = spec  # the engine's SpecDecoder
        self.requests = engine.requests

    def run_sync(self, out: SchedulerOutput, result: StepResult) -> tuple[list[TakenTokens], list]:
        """Synchronous step: run, append the sampled (or verified speculative) tokens; returns
        them, and the external sequences whose logits ``result`` hands out (the engine pauses
        them)."""
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
        taken, handed_out = [], []
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
            taken.append(TakenTokens(seq, old, len(seq), "sampled", lps))
        return taken, handed_out

    def launch(
        self, out: SchedulerOutput, result: StepResult
    ) -> tuple[list[TakenTokens], Resolution]:
        """Overlapped step: launch ``out``; returns its placeholders (values unknown: only the
        length limits can end a sequence now; its token arrives with the resolution) and the
        resolution of the step launched before it (``resolved`` takes its tokens)."""
        inp, rows = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self.requests.prompt_rows(
                seq, chunk.start_pos, len(chunk.token_ids)
            )
        sampling = sampling_metadata(self.requests, rows) if rows else None
        resolution = self.overlap.launch(out, inp, rows, sampling)
        result.num_generated_tokens += len(rows)
        launched = [TakenTokens(s, len(s) - 1, len(s), "launched") for s in rows]
        return launched, resolution

    def resolved(self, resolution: Resolution) -> list[TakenTokens]:
        """What reached the host (overlapped stepping): records its prompt logprobs and returns
        its tokens."""
        if resolution.prompt_logprobs is not None:
            chunks, scores = resolution.prompt_logprobs
            self.requests.record_prompt_logprobs(chunks, scores.entries())
        return [TakenTokens(r.seq, r.pos, r.pos + 1, "resolved") for r in resolution.tokens]
