"""LLMEngine: requests in, steps of (schedule -> run -> update) out.

One engine owns one model (a checkpoint directory or an in-memory HF model whose weights it
shares), its ModelRunner(s), a BlockManager and a Scheduler. ``step`` runs one forward pass over
whatever the scheduler picked (prefill chunks and decodes mixed) and reports finished requests.
Callers drive requests through ``stream`` / ``run`` (or ``request_group`` when they act between
steps; see ``request.py``), which abort and drain what is in flight when the caller stops early.

External sampling (used by the HF ``generate`` integration): such a request is never sampled or
stopped by the engine (except at ``max_model_len``). When its next-token logits are computed,
``step`` returns them and the sequence pauses, holding its blocks, until ``provide_token``;
``reset_tokens`` rewrites its tail (a draft model's request after the target's verification).

Speculative decoding: a request added with a ``proposer`` (``proposers.py``) verifies several
proposed tokens per step in one forward pass and keeps what the model agrees with
(``spec_decode.py``); its output is what it would be without the proposer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import count

import torch

from hf_paged.config import EngineConfig, SamplingParams
from hf_paged.engine.block_manager import BlockManager
from hf_paged.engine.outputs import RequestOutput
from hf_paged.engine.overlap import OverlapStepper
from hf_paged.engine.request import EngineRequest, RequestGroup, RequestStream, validate_prompt
from hf_paged.engine.request import run as _run_requests
from hf_paged.engine.request import stream as _stream_requests
from hf_paged.engine.request_state import RequestState, RequestTable
from hf_paged.engine.runtime import RuntimeInfo, resolve_runtime
from hf_paged.engine.scheduler import Scheduler
from hf_paged.engine.sequence import Sequence
from hf_paged.engine.spec_decode import SpecDecoder, check_proposer
from hf_paged.engine.step_profile import StepProfile
from hf_paged.engine.stepping import Stepper, StepResult
from hf_paged.engine.stop import StopStrings, StopStringsCache


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
        self.requests = RequestTable(self.runtime.device)
        self._paused: dict[int, Sequence] = {}  # external seqs waiting for provide_token
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
        spec_generator = torch.Generator(device=self.runtime.device)
        spec_generator.manual_seed(self.config.seed + 1)  # not the sampler's: its own stream
        self.spec = SpecDecoder(
            self.requests, self.runtime.max_model_len, self.runtime.vocab_size, spec_generator
        )
        self._stepper = Stepper(self, self._overlap, self.spec)

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
        proposer=None,
    ) -> int | str:
        """Queue a request; returns its id.

        Args:
            stop_strings: a matcher for ``params.stop`` built with the caller's tokenizer;
                None = built from the engine's tokenizer.
            proposer: proposes speculative tokens for it (``NgramProposer``,
                ``DraftModelProposer``); None = one token per step.

        Raises:
            ValueError / TypeError: bad input (named in the message); nothing is queued then.
        """
        self._check_open()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params={params!r} is not allowed: must be SamplingParams")
        ids = self.validate_prompt(prompt_token_ids)
        nxt = params.prompt_logprobs_next
        if nxt is not None and nxt >= self.runtime.vocab_size:
            raise ValueError(
                f"prompt_logprobs_next={nxt} is not allowed: must be in "
                f"[0, {self.runtime.vocab_size})"
            )
        if external_sampling and params.n != 1:
            raise ValueError(f"n={params.n} is not allowed with external sampling: must be 1")
        if proposer is not None:
            check_proposer(proposer)
            if external_sampling:
                raise ValueError(
                    "proposer=... is not allowed with external_sampling=True: the caller samples "
                    "each token itself"
                )
        matcher = self._stop_matchers.get(params.stop, stop_strings, self.tokenizer)
        rid = next(self._ids) if request_id is None else request_id
        req = RequestState.build(
            rid, prompt, ids, params, external_sampling, self.runtime.eos_token_ids, matcher,
            proposer,
        )  # fmt: skip
        self.requests.add(req)  # raises for a request id in use, before anything is queued
        for seq in req.seqs:
            self.scheduler.add(seq)
        return rid

    def abort(self, request_id) -> None:
        """Stop a request now; it is reported finished with reason "abort" by the next step."""
        req = self.requests.by_id.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self._paused.pop(seq.seq_id, None)
                self.finish_sequence(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def provide_token(self, request_id, token_id: int, *, finish: bool = False) -> None:
        """External sampling: append ``token_id`` to a paused request; ``finish`` ends it."""
        req = self.requests.by_id[request_id]
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
            self.finish_sequence(seq, "stop")
        elif len(seq) >= self.runtime.max_model_len:
            self.finish_sequence(seq, "length")
        else:
            self.scheduler.running.append(seq)

    def awaits_token(self, request_id) -> bool:
        """External sampling: the request is paused with its next-token logits handed out."""
        req = self.requests.by_id.get(request_id)
        return req is not None and req.seqs[0].seq_id in self._paused

    def reset_tokens(self, request_id, token_ids: list[int]) -> None:
        """External sampling: make the request's sequence hold exactly ``token_ids`` (its
        prompt first). The KV of the longest common prefix is kept (but for the last token,
        which is computed again so that the next step returns the logits after it), the rest
        is rolled back; the request runs again and pauses with those logits.

        Raises:
            ValueError: not an open external request, ``token_ids`` does not start with its
                prompt, or is as long as ``max_model_len``.
        """
        req = self.requests.by_id.get(request_id)
        if req is None or not req.external or req.seqs[0].is_finished:
            raise ValueError(f"request_id={request_id!r} is not an open external-sampling request")
        seq, ids = req.seqs[0], list(token_ids)
        if ids[: seq.num_prompt_tokens] != req.prompt_token_ids:
            raise ValueError(
                f"token_ids is not allowed for request_id={request_id!r}: must start with its "
                f"prompt ({seq.num_prompt_tokens} tokens)"
            )
        if len(ids) >= self.runtime.max_model_len:
            raise ValueError(
                f"token_ids of {len(ids)} tokens is not allowed: must be < max_model_len="
                f"{self.runtime.max_model_len}"
            )
        common = seq.num_prompt_tokens
        limit = min(len(seq), len(ids))
        while common < limit and seq.token_ids[common] == ids[common]:
            common += 1
        self.scheduler.rollback(seq, common, num_computed=min(common, len(ids) - 1))
        seq.token_ids.extend(ids[common:])
        if self._paused.pop(seq.seq_id, None) is not None:
            self.scheduler.running.append(seq)  # a preempted one stays in ``waiting``

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
        overlap = self._overlap is not None and not self.requests.num_sync
        if self._overlap is not None and not overlap:
            # a synchronous step needs every token on the host
            self._stepper.apply_resolved(self._overlap.drain())
        with self.profile.section("schedule"):
            if self.requests.num_spec:  # such requests step synchronously: tokens on the host
                self.spec.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            while out.is_empty and self._paused and self.scheduler.waiting:
                self._preempt_paused()  # paused sequences hold the blocks the waiting ones need
                out = self.scheduler.schedule()
        with self.profile.section("step_total"):
            if out.is_empty:
                if self._overlap is not None:
                    self._stepper.apply_resolved(self._overlap.drain())
            elif overlap:
                self._stepper.launch(out, result)
            else:
                self._stepper.run_sync(out, result)
            self._collect_finished(result)
        return result

    def _preempt_paused(self) -> None:
        seq = max(self._paused.values(), key=lambda s: s.arrival)
        del self._paused[seq.seq_id]
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.scheduler.add(seq)

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (its request is reported once all its sequences are done)."""
        if not seq.is_finished:
            self.spec.release(seq)
        self.scheduler.finish(seq, reason)
        self.requests.mark_finished(seq)

    def pause(self, seq: Sequence) -> None:
        """External sampling: ``seq`` holds its blocks and waits for ``provide_token``."""
        self.scheduler.running.remove(seq)
        self._paused[seq.seq_id] = seq

    def _collect_finished(self, result: StepResult) -> None:
        """Report requests whose last sequence finished (only those touched since last time);
        with overlapped stepping, not before their last token reached the host."""
        ready = self._overlap.ready if self._overlap is not None else None
        for req in self.requests.take_done(ready):
            result.finished.append(req.output(self.tokenizer))

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
            "spec_num_chunks": self.spec.num_spec_chunks,  # chunks that verified proposals
            "spec_num_draft_tokens": self.spec.num_draft_tokens,
            "spec_num_accepted_tokens": self.spec.num_accepted_tokens,
            "spec_acceptance_rate": self.spec.acceptance_rate,
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
