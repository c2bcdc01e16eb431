"""LLMEngine: requests in, steps of (schedule -> run -> report) out.

One engine owns one model (a checkpoint directory or an in-memory HF model whose weights it
shares), its ModelRunner(s), a BlockManager and a Scheduler. The step loop's rooms: ``step`` here
reads schedule -> run -> report in one place; ``stepping.py`` runs the model for a scheduled step
(synchronous, or launched ahead; ``overlap.py`` holds the steps still on the device);
``postprocess.py`` applies the stop rule to what a step appended. Callers drive requests through
``stream`` / ``run`` / ``request_group`` (``core/request_loop.py``).

External sampling (the HF ``generate`` integration): a request's next-token logits are handed
out by ``step`` and its sequence pauses until ``provide_token``; a beam search's beams are
replaced at once by ``provide_beams`` (``core/external_sequences.py`` owns the paused sequences).
A request with a ``proposer`` verifies several proposed tokens per step (``spec/``); one with a
``lora_key`` (``add_lora``) runs under that LoRA adapter beside others in the same steps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import count

import torch

from hf_paged.config import EngineConfig
from hf_paged.engine.core.block_manager import BlockManager
from hf_paged.engine.core.contracts import TakenTokens
from hf_paged.engine.core.encoder_cache import EncoderCache
from hf_paged.engine.core.external_sequences import ExternalSequences
from hf_paged.engine.core.outputs import RequestOutput
from hf_paged.engine.core.prompt_embeds import check_prompt_embeds
from hf_paged.engine.core.request import (
    EngineRequest,
    check_request,
    resolve_max_tokens,
    validate_bidirectional_ranges,
    validate_prompt,
)  # fmt: skip
from hf_paged.engine.core.request_loop import RequestGroup, RequestStream
from hf_paged.engine.core.request_loop import run as _run_requests
from hf_paged.engine.core.request_loop import stream as _stream_requests
from hf_paged.engine.core.request_state import RequestState, RequestTable
from hf_paged.engine.core.scheduler import Scheduler
from hf_paged.engine.core.sequence import Sequence
from hf_paged.engine.overlap import OverlapStepper
from hf_paged.engine.postprocess import Postprocessor
from hf_paged.engine.runtime import RuntimeInfo, resolve_runtime
from hf_paged.engine.spec.spec_decode import SpecDecoder
from hf_paged.engine.stats import engine_stats
from hf_paged.engine.stepping import Stepper, StepResult
from hf_paged.engine.stop_strings import StopStringsCache
from hf_paged.engine.worker.kv_readback import gather_kv
from hf_paged.timing.step_profile import StepProfile

logger = logging.getLogger(__name__)


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
        self.requests = RequestTable(lambda s: torch.Generator(self.runtime.device).manual_seed(s))
        self._closed = False
        self.profile = StepProfile()  # HF_PAGED_PROFILE=1 turns it on
        from hf_paged.engine.worker.executor import create_executor

        self.executor = create_executor(self.runtime, model)
        self._set_runtime_facts()
        rt = self.runtime
        self.block_manager = BlockManager(
            rt.num_kv_blocks, self.config.kv_block_size, rt.enable_prefix_caching,
            num_state_slots=rt.num_state_slots,
        )  # fmt: skip
        overlap = self.config.async_scheduling
        if overlap is None:  # auto: where the host has something to hide (one CUDA rank)
            overlap = self.runtime.device != "cpu" and self.config.tensor_parallel_size == 1
        max_loras = rt.lora.max_loras if rt.lora is not None else None
        self.scheduler = Scheduler(self.block_manager, self.config.max_num_seqs,
                                   self.config.max_num_batched_tokens, rt.max_model_len,
                                   max_loras=max_loras)  # fmt: skip
        # external seqs whose logits were handed out, waiting for their token; beams
        self.external = ExternalSequences(
            self.scheduler, self.block_manager, self.requests, self.runtime.vocab_size,
            self.runtime.max_model_len,
        )  # fmt: skip
        # the overlapped stepper; None: every step synchronous
        self.overlap = (
            OverlapStepper(self.executor, self.scheduler, self.profile) if overlap else None
        )
        self._stop_matchers = StopStringsCache()
        spec_generator = torch.Generator(device=self.runtime.device)
        spec_generator.manual_seed(self.config.seed + 1)  # not the sampler's: its own stream
        self.spec = SpecDecoder(
            self.requests, self.runtime.max_model_len, self.runtime.vocab_size, spec_generator
        )
        self._stepper = Stepper(self, self.overlap, self.spec)
        self.postprocess = Postprocessor(
            self.requests, self.scheduler, self.block_manager, self.runtime.max_model_len,
            self.spec.release,
        )  # fmt: skip

    def _set_runtime_facts(self) -> None:
        """What the executor's start decided, recorded in the runtime info (the config stays
        as the user gave it): the KV block count, recurrent state slots, and prefix caching,
        which is off for recurrent layers (a cached block has no state snapshot to start from)."""
        rt, runner = self.runtime, self.executor.runner
        rt.num_kv_blocks = self.executor.num_kv_blocks
        rt.num_state_slots, rt.state_slot_bytes = runner.num_state_slots, runner.state_slot_bytes
        rt.enable_prefix_caching = self.config.enable_prefix_caching and not rt.num_state_slots
        rt.encoder_cache = EncoderCache(self.config.encoder_cache_rows)  # image features (VLMs)
        if rt.num_state_slots and self.config.enable_prefix_caching:
            logger.info(
                "prefix caching is off: %s has recurrent layers, whose per-sequence state a "
                "cached KV prefix cannot restore", type(runner.model).__name__,
            )  # fmt: skip

    # ---- requests -----------------------------------------------------------------------

    def validate_prompt(self, prompt_token_ids) -> list[int]:
        """The prompt as a list of ints; ValueError naming what is wrong."""
        rt = self.runtime
        return validate_prompt(prompt_token_ids, rt.vocab_size, rt.max_model_len)

    def add_request(self, request: EngineRequest) -> int | str:
        """Queue a request (its fields say what it needs: ``EngineRequest``); returns its id.

        Raises:
            ValueError / TypeError: bad input (named in the message); nothing is queued then.
        """
        self._check_open()
        rt = self.runtime
        params = check_request(request, rt.vocab_size)
        proposer = request.proposer
        if proposer is not None and rt.num_state_slots:
            raise ValueError(f"proposer={type(proposer).__name__} is not allowed: the model has "
                             "recurrent layers, whose per-sequence state cannot take back rejected "
                             "speculative tokens; allowed: proposer=None")  # fmt: skip
        ids = self.validate_prompt(request.prompt_token_ids)
        ranges = validate_bidirectional_ranges(request.bidirectional_ranges, len(ids))
        key = request.lora_key
        if key is not None and (self.lora is None or not self.lora.has(key)):
            raise ValueError(f"lora_key={key!r} is not allowed: it is no adapter registered on "
                             "this engine (add_lora returns the key to pass)")  # fmt: skip
        params = resolve_max_tokens(params, len(ids), self.runtime.max_model_len)
        if request.prompt_embeds is not None:
            check_prompt_embeds(request.prompt_embeds, len(ids), self.hf_config, self.runtime.mrope)
        matcher = self._stop_matchers.get(params.stop, request.stop_strings, self.tokenizer)
        rid = next(self._ids) if request.request_id is None else request.request_id
        req = RequestState.build(
            rid, request.prompt, ids, params, request.external_sampling,
            self.runtime.eos_token_ids, matcher, proposer,
        )  # fmt: skip
        req.beam_search = request.beam_search
        for seq in req.seqs:
            seq.prompt_embeds = request.prompt_embeds
            seq.bidirectional_ranges = ranges
            seq.lora_key = request.lora_key
        self.requests.add(req)  # raises for a request id in use, before anything is queued
        for seq in req.seqs:
            self.scheduler.add(seq)
        return rid

    # ---- LoRA adapters ------------------------------------------------------------------

    @property
    def lora(self):
        """The runner's ``LoraManager`` (None: the engine was built without LoRA)."""
        return getattr(self.executor.runner, "lora", None)

    def add_lora(self, adapter) -> str:
        """Register a ``LoraAdapter``; returns the key requests pass as ``lora_key``.

        Raises:
            ValueError: the engine has no LoRA slots, or the adapter does not fit them (named).
        """
        if self.lora is None:
            raise ValueError(
                f"LoRA adapter {adapter.name!r} is not allowed: this engine was built without "
                "LoRA slots; build it with enable_lora=True"
            )
        return self.lora.add(adapter)

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name`` (every version); running requests must not use it."""
        if self.lora is not None:
            self.lora.remove_name(name)

    def abort(self, request_id) -> None:
        """Stop a request now; it is reported finished with reason "abort" by the next step."""
        req = self.requests.by_id.get(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.is_finished:
                self.external.forget(seq)
                self.finish_sequence(seq, "abort")

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """New values for some of the model's weights: ``(HF checkpoint name, full tensor)``
        pairs, as an RL loop sends its policy's weights. Every rank copies its part into the
        engine's own tensors (fused projections, shards, converted copies), in place, and the
        prefix cache, whose blocks hold keys and values of the old weights, is dropped. Nothing
        else is rebuilt: the KV cache, CUDA graphs and buffers stay.

        Returns:
            How many tensors rank 0 copied (a tensor that is the engine's own storage, shared
            with an in-memory model, is skipped).

        Raises:
            RuntimeError: requests are in flight (their KV would mix two sets of weights).
            ValueError: a name the model does not have, or a shape that does not fit.
            NotImplementedError: the model path can't copy in place (rebuild the engine).
        """
        self._check_open()
        if self.has_unfinished_requests():
            raise RuntimeError("update_weights is not allowed while requests are in flight")
        copied = self.executor.refresh_weights(list(weights))
        self.block_manager.reset_prefix_cache()
        self.runtime.encoder_cache.clear()  # image features of the old vision weights
        return copied

    def refresh_weights(self, source, names: set[str]) -> int:
        """The in-memory model ``source`` (the one the engine was built from) changed the
        weights ``names``: ``update_weights`` with their current values (a PEFT model's LoRA
        merged, as at load, or its base weights when LoRA slots serve the adapters;
        ``models.loader.iter_model_weights``)."""
        from hf_paged.models.loader import iter_model_weights

        slots = self.runtime.lora is not None and self.runtime.lora.from_peft  # LoRA unmerged
        return self.update_weights(iter_model_weights(source, names, merge_lora=not slots))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def provide_token(self, request_id, token_id: int, *, finish: bool = False) -> None:
        """External sampling: append ``token_id`` to a paused request; ``finish`` ends it."""
        seq = self.external.take_token(request_id, token_id)
        if finish:  # the caller ends it
            self.finish_sequence(seq, "stop")
            return
        self.postprocess.take([TakenTokens(seq, len(seq) - 1, len(seq), "provided")])
        if not seq.is_finished:
            self.external.resume(seq)

    def awaits_token(self, request_id) -> bool:
        """External sampling: the request is paused with its next-token logits handed out."""
        return self.external.awaits_token(request_id)

    def reset_tokens(self, request_id, token_ids: list[int]) -> None:
        """External sampling: the request's sequence holds exactly ``token_ids``
        (``ExternalSequences.reset_tokens``)."""
        self.external.reset_tokens(request_id, token_ids)

    def provide_beams(self, request_ids: list, parents: list[list[int]],
                      token_ids: list[list[int]]) -> None:  # fmt: skip
        """Beam search: every request of ``request_ids`` gets its next beams, beam ``j`` of
        request ``r`` continuing old beam ``parents[r][j]`` with ``token_ids[r][j]``, in one call
        (``ExternalSequences.provide_beams``)."""
        self.external.provide_beams(request_ids, parents, token_ids)

    def request_kv(self, request_ids: list) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every KV layer's keys and values of the requests' computed tokens, the requests'
        tokens one after another: ``[(k [T, H, D], v [T, H, Dv])]`` per KV layer, one gather
        per layer (``integration/contract/cache.py`` builds stock's cache from it). A paused
        external-sampling request has every token computed.

        Raises:
            ValueError: with tensor parallelism (each rank holds part of the heads), or a
                request unknown or not holding its blocks (``RequestTable.kv_slots``).
        """
        if self.config.tensor_parallel_size != 1:
            raise ValueError("request_kv reads rank 0's KV heads only: tensor_parallel_size=1")
        slots = self.requests.kv_slots(request_ids, self.config.kv_block_size)
        return gather_kv(self.executor.runner.kv_cache, slots, self.runtime.device)

    def request_states(self, request_ids: list) -> list[dict[str, torch.Tensor]]:
        """Every recurrent layer's states of the requests (``{name: [N, *shape]}`` per layer,
        in the mixers' order), read from their state-pool slots: a paused external-sampling
        request's state after every token it holds. Empty for a model without recurrent layers.

        Raises:
            ValueError: with tensor parallelism, or a request unknown or holding no slot.
        """
        if self.config.tensor_parallel_size != 1:
            raise ValueError("request_states reads rank 0's states only: tensor_parallel_size=1")
        pool = self.executor.runner.state_pool
        return [] if pool is None else pool.gather(self.requests.state_slots(request_ids))

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
        """One step: schedule, run, report. Reports finished requests and the logits of
        external-sampling requests."""
        self._check_open()
        result = StepResult()
        out, overlapped = self._schedule()
        with self.profile.section("step_total"):
            self._run(out, overlapped, result)  # the stop rule applied to the tokens it took
            ready = self.overlap.ready if self.overlap is not None else None
            result.finished += self.postprocess.collect(ready, self.tokenizer)
        return result

    def _schedule(self):
        """What this step runs (``SchedulerOutput``), and whether it runs overlapped (a
        synchronous step first takes every token still on the device)."""
        overlapped = self.overlap is not None and not self.requests.num_sync
        if self.overlap is not None and not overlapped:
            self.postprocess.take(self._stepper.resolved(self.overlap.drain()))
        with self.profile.section("schedule"):
            if self.requests.num_spec:  # such requests step synchronously: tokens on the host
                self.spec.propose(self.scheduler.running)
            out = self.scheduler.schedule()
            # paused sequences hold the blocks the waiting ones need: park them, newest first
            while out.is_empty and self.scheduler.waiting and self.external.park_newest():
                out = self.scheduler.schedule()
        return out, overlapped

    def _run(self, out, overlapped: bool, result: StepResult) -> None:
        """Run ``out`` (``stepping.py``) and apply the stop rule to the tokens it appended, in
        order; external-sampling rows whose logits were handed out pause."""
        if out.is_empty:
            if self.overlap is not None:
                self.postprocess.take(self._stepper.resolved(self.overlap.drain()))
        elif overlapped:
            launched, resolution = self._stepper.launch(out, result)
            self.postprocess.take(launched)
            self.postprocess.take(self._stepper.resolved(resolution))
        else:
            taken, handed_out = self._stepper.run_sync(out, result)
            self.postprocess.take(taken)
            for seq in handed_out:
                self.external.pause(seq)

    def finish_sequence(self, seq: Sequence, reason: str) -> None:
        """End ``seq`` (its request is reported once all its sequences are done)."""
        self.postprocess.finish(seq, reason)

    # ---- stats / lifecycle --------------------------------------------------------------

    @property
    def stats(self) -> dict:
        """The engine's counters (``stats.py``)."""
        return engine_stats(self)

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
