"""LLMEngine: requests in, steps of (schedule -> run -> update) out.

One engine owns one model (a checkpoint directory or an in-memory HF model whose weights it
shares), its ModelRunner(s), a BlockManager and a Scheduler. ``step`` runs one forward pass over
whatever the scheduler picked (prefill chunks and decodes mixed) and reports finished requests.
Callers drive requests through ``stream`` / ``run`` (or ``request_group`` when they act between
steps; see ``request.py``), which abort and drain what is in flight when the caller stops early.

External sampling (used by the HF ``generate`` integration): such a request is never sampled or
stopped by the engine (except at ``max_model_len``). When its next-token logits are computed,
``step`` returns them and the sequence pauses, holding its blocks, until ``provide_token``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

import torch

from hf_paged.config import EngineConfig, SamplingParams
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.outputs import CompletionOutput, RequestOutput, ScheduledChunk, SchedulerOutput
from hf_paged.engine.overlap import OverlapStepper, Resolution, overlap_eligible
from hf_paged.engine.prompt_logprobs import PromptLogprobState
from hf_paged.engine.request import EngineRequest, RequestGroup, RequestStream, validate_prompt
from hf_paged.engine.request import run as _run_requests
from hf_paged.engine.request import stream as _stream_requests
from hf_paged.engine.runtime import RuntimeInfo, resolve_runtime
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.step_profile import StepProfile
from hf_paged.engine.stop import StopStrings, StopStringsCache, check_stop
from hf_paged.layers.sampler import SamplingMetadata


@dataclass
class StepResult:
    finished: list[RequestOutput] = field(default_factory=list)
    # external-sampling requests: request_id -> next-token raw logits [V] float32 (on the
    # engine's device)
    logits: dict = field(default_factory=dict)
    num_generated_tokens: int = 0  # tokens sampled (or handed out as logits) by this step


@dataclass
class _Request:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    external: bool
    logprobs: dict[int, list] = field(default_factory=dict)  # seq_id -> per-token logprobs
    sync_only: bool = False  # overlapped stepping cannot serve it
    stop_ids: tuple[int, ...] = ()  # ids that end it: EOS (unless ignore_eos) + stop_token_ids
    stop_strings: StopStrings | None = None  # matcher for params.stop
    prompt_lps: PromptLogprobState | None = None  # with params.prompt_logprobs (seqs[0] scores)


class LLMEngine:
    """Paged-KV engine for one model.

    Args:
        model: a checkpoint directory (config.json + safetensors, tokenizer optional) or an
            already loaded HF causal-LM (its weights are shared, not copied, where possible).
        config: an EngineConfig, a dict of its keys, or None for defaults.
        tokenizer: overrides the tokenizer found beside the checkpoint.

    Raises:
        TypeError: an unknown config key.
        ValueError: a bad config value or an unsupported architecture.
    """

    def __init__(self, model, config: EngineConfig | dict | None = None, tokenizer=None):
        self.config = EngineConfig.from_dict(config)
        self.runtime: RuntimeInfo = resolve_runtime(model, self.config)
        self.hf_config = self.runtime.hf_config
        self.tokenizer = tokenizer if tokenizer is not None else self.runtime.tokenizer
        self._ids = count()
        self._requests: dict[int | str, _Request] = {}
        self._seq_to_req: dict[int, _Request] = {}
        self._generators: dict[int, torch.Generator] = {}
        self._paused: dict[int, Sequence] = {}  # external seqs waiting for provide_token
        self._maybe_done: set[int] = set()  # seq ids finished since the last collection
        self._num_sync_requests = 0  # requests that overlapped stepping cannot serve
        self._closed = False
        self.profile = StepProfile()  # HF_PAGED_PROFILE=1 turns it on
        from hf_paged.engine.executor import create_executor

        self.executor = create_executor(self.runtime, model)
        self.runtime.num_kv_blocks = self.executor.num_kv_blocks
        self.block_manager = BlockManager(
            self.runtime.num_kv_blocks, self.config.kv_block_size, self.config.enable_prefix_caching
        )
        overlap = self.config.async_scheduling
        if overlap is None:  # auto: where the host has something to hide (one CUDA rank)
            overlap = self.runtime.device != "cpu" and self.config.tensor_parallel_size == 1
        self.scheduler = Scheduler(
            self.block_manager,
            self.config.max_num_seqs,
            self.config.max_num_batched_tokens,
            self.runtime.max_model_len,
        )
        self._overlap = (
            OverlapStepper(self.executor, self.scheduler, self.profile) if overlap else None
        )
        self._stop_matchers = StopStringsCache()

    # ---- requests -----------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids) -> list[int]:
        """The prompt as a list of ints; ValueError naming what is wrong."""
        return validate_prompt(
            prompt_token_ids, self.runtime.vocab_size, self.runtime.max_model_len
        )

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | None = None,
        request_id: int | str | None = None,
        *,
        prompt: str | None = None,
        external_sampling: bool = False,
        stop_strings: StopStrings | None = None,
    ) -> int | str:
        """Queue a request; returns its id.

        Args:
            stop_strings: a matcher for ``params.stop`` built with the caller's tokenizer;
                None = built from the engine's tokenizer.

        Raises:
            ValueError / TypeError: bad input (named in the message); nothing is queued then.
        """
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params={params!r} is not allowed: must be SamplingParams")
        ids = self.validate_prompt(prompt_token_ids)
        if external_sampling and params.n != 1:
            raise ValueError(f"n={params.n} is not allowed with external sampling: must be 1")
        matcher = self._stop_matchers.get(params.stop, stop_strings, self.tokenizer)
        rid = next(self._ids) if request_id is None else request_id
        if rid in self._requests:
            raise ValueError(f"request_id={rid!r} is not allowed: it is already in use")
        seqs = [Sequence(ids, params, request_id=rid) for _ in range(params.n)]
        req = _Request(rid, prompt, ids, params, seqs, external_sampling, stop_strings=matcher)
        self._requests[rid] = req
        req.sync_only = not overlap_eligible(params, external_sampling)
        eos = () if params.ignore_eos else self.runtime.eos_token_ids
        req.stop_ids = tuple(eos) + params.stop_token_ids  # once, not per step
        self._num_sync_requests += req.sync_only
        if params.prompt_logprobs is not None:
            req.prompt_lps = PromptLogprobState(
                ids, params.prompt_logprobs, params.prompt_logprobs_start
            )
            seqs[0].max_cached_tokens = req.prompt_lps.max_cached_tokens
        for i, seq in enumerate(seqs):
            self._seq_to_req[seq.seq_id] = req
            if params.seed is not None:
                g = torch.Generator(device=self.runtime.device)
                g.manual_seed(params.seed + i)
                self._generators[seq.seq_id] = g
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id) -> None:
        """Stop a request now; it is reported finished with reason "abort" by the next step."""
        req = self._requests.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._paused.pop(seq.seq_id, None)
                self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def provide_token(self, request_id, token_id: int, *, finish: bool = False) -> None:
        """External sampling: append ``token_id`` to a paused request; ``finish`` ends it."""
        req = self._requests[request_id]
        seq = req.seqs[0]
        if seq.seq_id not in self._paused:
            raise ValueError(f"request_id={request_id!r} is not waiting for a token")
        if not (0 <= token_id < self.runtime.vocab_size):
            raise ValueError(
                f"token_id={token_id} is not allowed: must be in [0, {self.runtime.vocab_size})"
            )
        del self._paused[seq.seq_id]
        seq.append_token(int(token_id))
        if finish:
            self._finish(seq, "stop")
        elif len(seq) >= self.runtime.max_model_len:
            self._finish(seq, "length")
        else:
            self.scheduler.running.append(seq)

    # ---- driving requests ---------------------------------------------------------------

    def request_group(self) -> RequestGroup:
        """A group for step-wise callers: ``with engine.request_group() as g: g.add(...);
        g.step() ...``; leaving it by an exception aborts and drains its open requests."""
        return RequestGroup(self)

    def stream(self, requests: Iterable[EngineRequest], *, max_in_flight: int | None = None,
               progress: Callable[[int], None] | None = None) -> RequestStream:  # fmt: skip
        """Yield ``(input index, RequestOutput)`` as requests finish (see ``request.stream``)."""
        return _stream_requests(self, requests, max_in_flight=max_in_flight, progress=progress)

    def run(self, requests: Iterable[EngineRequest], **kwargs) -> list[RequestOutput]:
        """Every request to completion, outputs in input order (``stream``'s keywords)."""
        return _run_requests(self, requests, **kwargs)

    # ---- stepping -----------------------------------------------------------------------

    def step(self) -> StepResult:
        """One forward pass over what the scheduler picks; reports finished requests and the
        logits of external-sampling requests."""
        self._check_open()
        result = StepResult()
        overlap = self._overlap is not None and not self._num_sync_requests
        if self._overlap is not None and not overlap:
            # a synchronous step needs every token on the host
            self._apply_resolved(self._overlap.drain())
        with self.profile.section("schedule"):
            out = self.scheduler.schedule()
            while out.is_empty and self._paused and self.scheduler.waiting:
                self._preempt_paused()  # paused sequences hold the blocks the waiting ones need
                out = self.scheduler.schedule()
        with self.profile.section("step_total"):
            if out.is_empty:
                if self._overlap is not None:
                    self._apply_resolved(self._overlap.drain())
            elif overlap:
                self._launch(out, result)
            else:
                self._run(out, result)
            self._collect_finished(result)
        return result

    def _preempt_paused(self) -> None:
        seq = max(self._paused.values(), key=lambda s: s.arrival)
        del self._paused[seq.seq_id]
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.scheduler.add(seq)

    def _run(self, out: SchedulerOutput, result: StepResult) -> None:
        """Synchronous step: run, append the sampled tokens, check stops."""
        inp, sampled_seqs = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self._prompt_rows(seq, chunk.start_pos, len(chunk.token_ids))
        external = tuple(
            i for i, s in enumerate(sampled_seqs) if self._seq_to_req[s.seq_id].external
        )
        ext_rows = set(external)
        internal = [s for i, s in enumerate(sampled_seqs) if i not in ext_rows]
        sampling = self._sampling_metadata(internal) if internal else None
        ro = self.executor.run(inp, sampling, external)
        if ro.prompt_logprobs is not None:
            self._record_prompt_logprobs(inp.chunks, ro.prompt_logprobs)
        ext_ids = {sampled_seqs[i].seq_id for i in external}  # they get logits, not a token
        tokens = iter(ro.sampled_token_ids)
        sampled = []
        for c in inp.chunks:
            tok = next(tokens) if c.sample else None
            sampled.append(None if c.seq_id in ext_ids else tok)
        self.scheduler.update(out, sampled)
        result.num_generated_tokens += len(sampled_seqs)
        for row, seq in enumerate(sampled_seqs):
            req = self._seq_to_req[seq.seq_id]
            if req.external:
                self.scheduler.running.remove(seq)
                self._paused[seq.seq_id] = seq
                result.logits[req.request_id] = ro.logits[row]
                continue
            if ro.logprobs is not None and req.params.logprobs is not None:
                req.logprobs.setdefault(seq.seq_id, []).append(ro.logprobs[row])
            hit = req.stop_strings is not None and req.stop_strings.matches(seq.token_ids)
            reason = check_stop(
                seq.num_output_tokens, seq.last_token_id, len(seq), req.params, req.stop_ids,
                self.runtime.max_model_len, stop_string_hit=hit,
            )  # fmt: skip
            if reason is not None:
                self._finish(seq, reason)

    def _launch(self, out: SchedulerOutput, result: StepResult) -> None:
        """Overlapped step: launch ``out``, end what reaches a length limit, then apply the
        tokens of the step launched before it."""
        inp, rows = out.model_input()
        for seq, chunk in zip(out.seqs, inp.chunks, strict=True):
            chunk.prompt_rows = self._prompt_rows(seq, chunk.start_pos, len(chunk.token_ids))
        sampling = self._sampling_metadata(rows) if rows else None
        resolved = self._overlap.launch(out, inp, rows, sampling)
        result.num_generated_tokens += len(rows)
        for seq in rows:  # token values unknown: only the length limits can end it now
            reason = check_stop(
                seq.num_output_tokens, None, len(seq), seq.sampling_params, (),
                self.runtime.max_model_len,
            )  # fmt: skip
            if reason is not None:
                self._finish(seq, reason)  # its token arrives with the resolution
        self._apply_resolved(resolved)

    def _apply_resolved(self, resolved: Resolution) -> None:
        """Prompt logprobs and stop checks on what just reached the host (overlapped
        stepping)."""
        if resolved.prompt_logprobs is not None:
            chunks, scores = resolved.prompt_logprobs
            self._record_prompt_logprobs(chunks, scores.entries())
        for r in resolved.tokens:
            seq = r.seq
            req = self._seq_to_req[seq.seq_id]
            n_out = r.pos + 1 - seq.num_prompt_tokens
            hit = req.stop_strings is not None and req.stop_strings.matches(
                seq.token_ids, r.pos + 1
            )
            stopped = "stop" == check_stop(
                n_out, r.token_id, r.pos + 1, req.params, req.stop_ids, self.runtime.max_model_len,
                stop_string_hit=hit,
            )  # fmt: skip
            if seq.is_finished:  # by a length limit at launch, or aborted
                if stopped:
                    del seq.token_ids[r.pos + 1 :]  # drop tokens launched after the stop
                    if seq.finish_reason == "length":
                        seq.finish_reason = "stop"  # as the synchronous path reports it
                self._maybe_done.add(seq.seq_id)
                continue
            self.block_manager.cache_full_blocks(seq)
            if stopped:
                del seq.token_ids[r.pos + 1 :]  # drop the token of the step still in flight
                self._finish(seq, "stop")

    def _prompt_rows(self, seq: Sequence, start: int, n: int):
        state = self._seq_to_req[seq.seq_id].prompt_lps
        if state is None or seq.seq_id != self._seq_to_req[seq.seq_id].seqs[0].seq_id:
            return None
        rows = state.rows_for(start, n)  # taken now: their scores may arrive a step later
        seq.max_cached_tokens = state.max_cached_tokens
        return rows

    def _record_prompt_logprobs(self, chunks: list[ScheduledChunk], scores: dict) -> None:
        for c in chunks:
            req = self._seq_to_req.get(c.seq_id)
            if c.seq_id in scores and req is not None:  # None: aborted and reported meanwhile
                req.prompt_lps.record(c, scores[c.seq_id])

    def stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        return self._seq_to_req[seq.seq_id].stop_ids

    def _sampling_metadata(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [s.sampling_params for s in seqs]
        # token histories are copied only when some row's penalties or min_tokens read them
        history = any(
            p.repetition_penalty != 1.0 or p.presence_penalty or p.frequency_penalty or p.min_tokens
            for p in params
        )
        return SamplingMetadata(
            params=params,
            prompt_token_ids=[s.token_ids[: s.num_prompt_tokens] if history else [] for s in seqs],
            output_token_ids=[s.output_token_ids if history else [] for s in seqs],
            stop_token_ids=[self.stop_ids(s) for s in seqs],
            generators=[self._generators.get(s.seq_id) for s in seqs],
        )

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        self._maybe_done.add(seq.seq_id)

    def _collect_finished(self, result: StepResult) -> None:
        """Report requests whose last sequence finished (only those touched since last time)."""
        later = set()  # finished, but a token of theirs is still on the device
        for seq_id in self._maybe_done:
            req = self._seq_to_req.get(seq_id)
            if req is None or req.request_id not in self._requests:
                continue
            if all(s.is_finished for s in req.seqs):
                if self._overlap is not None and not all(
                    self._overlap.ready(s.seq_id) for s in req.seqs
                ):
                    later.add(seq_id)
                    continue
                del self._requests[req.request_id]
                self._num_sync_requests -= req.sync_only
                for seq in req.seqs:
                    self._seq_to_req.pop(seq.seq_id, None)
                    self._generators.pop(seq.seq_id, None)
                result.finished.append(self._request_output(req))
        self._maybe_done = later

    def _request_output(self, req: _Request) -> RequestOutput:
        outs = []
        for i, seq in enumerate(req.seqs):
            ids = seq.output_token_ids
            text = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(
                    ids, skip_special_tokens=req.params.skip_special_tokens
                )
            lps = req.logprobs.get(seq.seq_id) if req.params.logprobs is not None else None
            outs.append(CompletionOutput(i, ids, text, seq.finish_reason, lps))
        plps = req.prompt_lps.entries if req.prompt_lps is not None else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, plps)

    # ---- stats / lifecycle --------------------------------------------------------------

    @property
    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_preemptions": self.scheduler.num_preemptions,
            "max_num_running_seqs": self.scheduler.max_num_running_seqs,
            "prefix_cache_query_tokens": bm.num_prefix_queries_tokens,
            "prefix_cache_hit_tokens": bm.num_prefix_hit_tokens,
            "prefix_cache_hit_rate": bm.prefix_cache_hit_rate,
            "num_kv_blocks": self.runtime.num_kv_blocks,
            "num_free_blocks": bm.num_free_blocks,
            "num_overlapped_steps": self._overlap.num_launched if self._overlap else 0,
            "num_held_back": self.scheduler.num_held_back,  # waits for a prefix being prefilled
            **self._profile_stats(),
        }

    def _profile_stats(self) -> dict:
        if not self.profile.enabled:
            return {}
        prof = self.profile.summary()
        runner = getattr(self.executor, "runner", None)
        if runner is not None:
            prof.update(runner.profile.summary())
        return {"profile": prof}

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this engine is closed")

    def close(self) -> None:
        """Free the KV cache, stop worker processes. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self.executor.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:
                pass
