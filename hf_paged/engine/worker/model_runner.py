"""ModelRunner: one per rank. Loads the model, owns the KV cache, turns a ModelInput into tensors,
runs the forward pass (eager or a captured decode CUDA graph) and, on rank 0, samples.

Construction, in order: process group -> model + weights on the rank's device ->
``warmup_model`` (peak memory) -> ``allocate_kv_cache`` -> ``capture_cudagraph``. On CUDA the
cache is sized from the engine's share of the device (``gpu_memory_utilization``; the arithmetic
is ``kv_budget.plan_kv_cache``), and ``exit`` gives every byte the runner allocated back to the
driver, so an engine can be closed and rebuilt, or share the device with other engines.
The model is any ``hf_paged.models.protocol.PagedModel``: the runner sizes the ``KVCache`` from
its ``kv_cache_specs`` and passes the cache in every step's ``AttentionMetadata.kv_cache``.
Rank 0 lives in the engine's process; ranks 1..N-1 live in worker processes whose loop
(``tp.workers.WorkerGroup``) dispatches what rank 0 broadcasts, by method name, to their runner.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import torch

from hf_paged import envs as hf_envs
from hf_paged.attention import select_backend
from hf_paged.attention.kv_cache import KVCache, KVCacheSpec
from hf_paged.distributed.communicator import Communicator
from hf_paged.engine.core.contracts import ModelInput
from hf_paged.engine.worker import runner_memory
from hf_paged.engine.worker.cuda_graph import eager_refusal
from hf_paged.engine.worker.kv_budget import check_kv_blocks
from hf_paged.engine.worker.prompt_scores import score_prompt_rows
from hf_paged.engine.worker.runner_memory import RunnerMemory
from hf_paged.engine.worker.runner_output import PendingTokens, RunnerOutput
from hf_paged.engine.worker.runner_spec import RunnerSpec, model_name, refusals_named
from hf_paged.engine.worker.step_inputs import StepEmbeds, StepInputs
from hf_paged.layers.context import ModelContext
from hf_paged.layers.sampler import Sampler, SamplingMetadata
from hf_paged.models.adapters import LoraManager
from hf_paged.models.autocast import under
from hf_paged.models.loader import BaseWeights
from hf_paged.models.recurrent.state_pool import StatePool
from hf_paged.models.registry import build_model
from hf_paged.timing import spans
from hf_paged.timing.step_profile import StepProfile

_engine_numbers = itertools.count(1)  # names this process's engines in memory errors


class ModelRunner:
    def __init__(self, spec: RunnerSpec, rank: int = 0, comm: Communicator | None = None):
        hf_envs.apply(spec.envs)  # before anything reads a switch: every rank runs with rank 0's
        self.spec = spec
        self.config = spec.config
        self.rank = rank
        self.comm = comm or Communicator()
        self.world_size = self.comm.world_size
        self.block_size = spec.config.kv_block_size
        self.device = torch.device(spec.device)
        self.dtype = spec.dtype
        # the KV cache's dtype: the model's, or float8_e4m3fn (kv_cache_dtype="fp8")
        self.kv_dtype = torch.float8_e4m3fn if spec.config.kv_cache_dtype != "auto" else spec.dtype
        self.max_model_len = spec.max_model_len
        self.autocast = spec.autocast  # forwards and heads run under it (``models/autocast.py``)

        self.kv_cache: KVCache | None = None
        self.state_pool: StatePool | None = None  # recurrent layers' states (``_build``)
        self.graph_runner = None
        self.sampler = None
        self.model = None
        self.lora = None  # the ``LoraManager`` of an engine with LoRA slots
        self.profile = StepProfile(prefix="runner")  # HF_PAGED_PROFILE=1 turns it on
        self.inputs = StepInputs(self.device, self.block_size)  # host -> device step inputs
        # what this runner holds on its device; on CUDA its KV budget (a byte count elsewhere)
        name = f"engine {next(_engine_numbers)}: " + model_name(spec)
        self.memory = RunnerMemory(runner_memory.probe_for(self.device), str(self.device), name)
        try:
            self._build(spec)
        except BaseException:
            self.exit()  # a failed start gives its memory and its process group back too
            raise

    def _build(self, spec: RunnerSpec) -> None:
        backend = select_backend(self.device.type, spec.config.attention_backend)
        self.attn_backend = backend
        self.ctx = ModelContext(
            backend, self.comm, kv_block_size=self.block_size, max_model_len=self.max_model_len
        )
        with spans.span("engine_start.model_load"), refusals_named(spec.hf_config):
            self.model = build_model(
                spec.hf_config, self.ctx, self.dtype, self.device, spec.config.model_impl
            )
            source = spec.model_source
            if spec.lora is not None and spec.lora.from_peft:
                source = BaseWeights(source)  # the adapters are served from slots
            self.model.load_weights(source)
        if spec.lora is not None:
            prefix = "hf_model." if hasattr(self.model, "hf_model") else ""
            self.lora = LoraManager(self.model, spec.lora, self.device, self.dtype, prefix)
        # drop the source: an in-memory HF model must not be kept alive by its engine
        self.spec = spec = dataclasses.replace(spec, model_source=None)
        self.model.eval()
        self.kv_specs: list[KVCacheSpec] = list(self.model.kv_cache_specs)
        state_specs = list(getattr(self.model, "state_specs", None) or [])
        if not self.kv_specs and not state_specs:
            raise ValueError(f"{type(self.model).__name__}.kv_cache_specs is empty")
        # recurrent layers: one state slot per sequence that can run, allocated before the
        # warm-up so that the KV cache is sized from what is left
        self.state_pool = None
        if state_specs:
            self.state_pool = StatePool(state_specs, spec.config.max_num_seqs, self.device)
            self.inputs.state_pool = self.state_pool
        generator = torch.Generator(device=self.device).manual_seed(self.config.seed)
        self.sampler = Sampler(generator) if self.rank == 0 else None

        with spans.span("engine_start.warmup"):  # Triton compiles of the prefill kernels
            self.warmup_model()
        self.memory.loaded()
        with spans.span("engine_start.kv_cache"):
            self.num_kv_blocks = self.allocate_kv_cache()
        refusal = eager_refusal(self.config, self.model, self.attn_backend, self.ctx, self.lora)
        self.cuda_graph_reason = None if refusal is None else refusal.detail
        if self.device.type == "cuda" and self.cuda_graph_reason is None:
            with spans.span("engine_start.cuda_graphs"), self.memory.cuda_graphs():
                self.capture_cudagraph()  # decode compiles and captures
        self.memory.register(self.kv_cache.nbytes())

    # ---- construction steps -------------------------------------------------------------

    def _set_kv_cache(self, num_blocks: int) -> KVCache:
        """Set the runner's KV cache to a zeroed one of ``num_blocks`` blocks (the steps
        prepared from now on carry it in their metadata)."""
        self.kv_cache = KVCache(
            self.kv_specs, num_blocks, self.block_size, self.kv_dtype, self.device
        )
        return self.kv_cache

    def warmup_model(self) -> None:
        """A synthetic prefill at the largest step size, to compile kernels and measure the
        activations' peak memory (``RunnerMemory.profile_run``). Only where the KV cache is
        sized from memory (CUDA): on CPU the budget is a byte count. Its temporaries (a small
        KV cache, the inputs) are freed and handed back."""
        if not self.memory.active:
            return
        step = self._warmup_inputs()
        with self.memory.profile_run():
            self._warmup_forward(*step)
        del step
        self.kv_cache.release()
        self.kv_cache = None
        self.memory.probe.release_cached(collect=False)  # plain temporaries: no cycles

    @property
    def activation_peak_bytes(self) -> int:
        return self.memory.activation_peak

    def _warmup_inputs(self):
        """A temporary real KV cache and the largest prefill step's inputs, made by
        ``StepInputs.prefill`` as for a served step, so the kernels compile for the same layout."""
        max_tokens = self.config.max_num_batched_tokens
        seq_len = min(self.max_model_len, max_tokens)
        num_seqs = max(1, min(max_tokens // seq_len, self.config.max_num_seqs))
        blocks_per_seq = -(-seq_len // self.block_size)
        self._set_kv_cache(num_seqs * blocks_per_seq)  # freed by the caller
        inp = ModelInput.synthetic_prefill([seq_len] * num_seqs, blocks_per_seq)
        return self.inputs.prefill(inp, self.kv_cache)

    @torch.inference_mode()
    def _warmup_forward(self, input_ids, positions, meta, logits_idx) -> torch.Tensor | None:
        with under(self.autocast):
            hidden = self.model(input_ids, positions, meta)
            return self._logits(hidden[logits_idx])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The model's ``compute_logits``; float32 under autocast (its head gives bf16)."""
        logits = self.model.compute_logits(hidden)
        return logits if self.autocast is None or logits is None else logits.float()

    def kv_block_bytes(self) -> int:
        """Bytes one block id costs: every layer's K and V (layers may differ)."""
        return KVCache.block_bytes(self.kv_specs, self.block_size, self.kv_dtype)

    def allocate_kv_cache(self) -> int:
        """Size and allocate the KV cache; returns the block count (MIN over ranks). Without
        ``num_kv_blocks`` / ``kv_cache_bytes``, on CUDA, the count comes from the engine's
        share of the device (``RunnerMemory.plan_kv_cache``).

        Raises:
            KVCacheMemoryError: the share is not free, or holds too few blocks (with TP: raised
                after every rank took part in the MIN, so none waits on the others).
            ValueError: a fixed count below one max_model_len sequence.
        """
        block_bytes = self.kv_block_bytes()
        num_blocks, error = self.memory.own_kv_blocks(
            self.config, block_bytes, self.block_size, self.max_model_len
        )
        own = num_blocks
        t = torch.tensor([num_blocks], dtype=torch.int64, device=self.device)
        num_blocks = int(self.comm.all_reduce(t, op="min").item())  # every rank the same count
        if error is not None:
            raise error
        check_kv_blocks(num_blocks, own, block_bytes, self.block_size, self.max_model_len)
        self._set_kv_cache(num_blocks)
        return num_blocks

    @torch.inference_mode(False)
    def refresh_weights(
        self, weights: list[tuple[str, torch.Tensor]], dry_run: bool = False
    ) -> int:
        """Copy ``(HF name, full tensor)`` pairs into this rank's parameters, in place (the KV
        cache, graphs and buffers stay as they are). Returns how many tensors were copied;
        ``dry_run`` judges names and shapes and writes nothing.

        Raises:
            NotImplementedError: the model has no ``refresh_weights`` (the caller rebuilds).
            ValueError: a name the model lacks or a shape that does not fit.
        """
        refresh = getattr(self.model, "refresh_weights", None)
        if refresh is None:
            raise NotImplementedError(f"{type(self.model).__name__} has no refresh_weights")
        with spans.span("engine.refresh_weights"):
            return refresh(weights, dry_run=dry_run)

    def capture_cudagraph(self) -> None:
        from hf_paged.engine.worker.cuda_graph import DecodeGraphRunner

        self.graph_runner = DecodeGraphRunner(self)

    # ---- per step -----------------------------------------------------------------------

    @torch.inference_mode()
    def run_model(self, input_ids, positions, meta, logits_indices,
                  embeds: StepEmbeds | None = None) -> torch.Tensor | None:  # fmt: skip
        """Forward pass -> logits [N_sample, V] on rank 0 (None elsewhere). Decode batches
        replay the smallest captured graph that fits. ``embeds``: the step's prompt-embedding
        rows (``StepInputs.prompt_embeds``), fed instead of the ids' embeddings."""
        with under(self.autocast):
            if meta.is_decode and self.graph_runner is not None and self.graph_runner.fits(meta):
                hidden = self.graph_runner.replay(input_ids, positions, meta)
            else:
                hidden = self._forward(input_ids, positions, meta, embeds)
            return self._logits(hidden[logits_indices])

    def _forward(self, input_ids, positions, meta, embeds: StepEmbeds | None) -> torch.Tensor:
        if embeds is None:
            return self.model(input_ids, positions, meta)
        return self.model(input_ids, positions, meta, embeds=embeds)

    @torch.inference_mode()
    def run_model_scoring(self, inp: ModelInput, input_ids, positions, meta, logits_indices,
                          embeds: StepEmbeds | None = None):  # fmt: skip
        """``run_model`` for a step with prompt-logprob rows (never a decode graph): also
        returns their ``PromptScores`` on rank 0, still on the device (``score_prompt_rows``)."""
        with under(self.autocast):
            hidden = self._forward(input_ids, positions, meta, embeds)  # [T, H]
            logits = self._logits(hidden[logits_indices])
            scores = score_prompt_rows(self._logits, hidden, inp.chunks, meta.cu_seqlens_q_cpu)
        return logits, scores

    def run(
        self,
        inp: ModelInput,
        sampling: SamplingMetadata | None = None,
        external_rows: tuple[int, ...] = (),
    ) -> RunnerOutput | None:
        """One engine step. Rank 0 samples the logits rows not in ``external_rows`` (indices
        among all logits rows, ``ScheduledChunk.num_logits`` per sampling chunk) with
        ``sampling`` (one row each, in order) and returns the external rows' raw logits."""
        prof = self.profile
        with prof.section("prepare"):
            self.kv_cache.copy_blocks(inp.blocks_to_copy)  # forks' copy on write, before writes
            if self.state_pool is not None:
                self.state_pool.copy_states(inp.states_to_copy)
            input_ids, positions, meta, logits_idx = self.inputs.build(inp, self.kv_cache)
            embeds = None if meta.is_decode else self.inputs.prompt_embeds(inp, self.dtype)
            if self.lora is not None:
                self.lora.prepare(inp.chunks)
        scores = None
        with prof.section("forward_launch"):
            if any(c.prompt_rows is not None for c in inp.chunks):
                logits, scores = self.run_model_scoring(
                    inp, input_ids, positions, meta, logits_idx, embeds
                )
            else:
                logits = self.run_model(input_ids, positions, meta, logits_idx, embeds)
        if self.rank != 0 or logits is None:
            return None
        num_rows = logits.shape[0]
        external = set(external_rows)
        internal = [i for i in range(num_rows) if i not in external]
        scores = scores.copy_to_host() if scores is not None else None  # read after sampling
        out = RunnerOutput(sampled_token_ids=[-1] * num_rows)
        if internal:
            rows = logits if not external else logits[internal]
            with prof.section("sample_launch"):
                result = self.sampler(rows, sampling)
            with prof.section("wait_gpu"):  # the step's only host sync
                tokens = result.token_ids.tolist()
            for i, tok in zip(internal, tokens):
                out.sampled_token_ids[i] = tok
            if result.logprobs is not None:
                out.logprobs = [None] * num_rows
                for i, lp in zip(internal, result.logprobs):
                    out.logprobs[i] = lp
        if external:
            # they stay on the device: HF's processors and criteria run there, as in stock
            ext_logits = logits[list(external_rows)].float()
            out.logits = [None] * num_rows
            for j, i in enumerate(external_rows):
                out.logits[i] = ext_logits[j]
        if scores is not None:
            out.prompt_logprobs = scores.entries()
        return out

    def run_async(
        self,
        inp: ModelInput,
        sampling: SamplingMetadata | None,
        prev: PendingTokens | None = None,
        prev_rows: list[int] | None = None,
    ) -> PendingTokens:
        """Rank 0, one rank: like ``run`` for internally sampled rows, without waiting for the
        tokens. A chunk whose ``prev_rows`` entry is r >= 0 is one placeholder token whose value
        is row r of ``prev``'s sampled tokens, taken on the device."""
        prof = self.profile
        with prof.section("prepare"):
            self.kv_cache.copy_blocks(inp.blocks_to_copy)
            if self.state_pool is not None:
                self.state_pool.copy_states(inp.states_to_copy)
            input_ids, positions, meta, logits_idx = self.inputs.build(inp, self.kv_cache)
            if self.lora is not None:
                self.lora.prepare(inp.chunks)
            if prev is not None and prev_rows is not None:
                cu = meta.cu_seqlens_q_cpu
                pairs = [(cu[i], r) for i, r in enumerate(prev_rows) if r >= 0]
                if pairs:
                    idx = self.inputs.to_device(np.array(pairs, dtype=np.int64).T.copy(), "prev")
                    input_ids[idx[0]] = prev.tokens[idx[1]]
            embeds = None if meta.is_decode else self.inputs.prompt_embeds(inp, self.dtype)
        scores = None
        with prof.section("forward_launch"):
            if any(c.prompt_rows is not None for c in inp.chunks):
                logits, scores = self.run_model_scoring(
                    inp, input_ids, positions, meta, logits_idx, embeds
                )
            else:
                logits = self.run_model(input_ids, positions, meta, logits_idx, embeds)
        with prof.section("sample_launch"):
            if sampling is None:  # prefill chunks only: nothing sampled
                return PendingTokens(logits.new_empty(0, dtype=torch.int64), scores)
            return PendingTokens(self.sampler(logits, sampling).token_ids, scores)

    @property
    def num_state_slots(self) -> int:
        """State slots of a recurrent model's pool (0 without recurrent layers)."""
        return self.state_pool.num_slots if self.state_pool is not None else 0

    @property
    def state_slot_bytes(self) -> int:
        """Bytes one sequence's recurrent states take over all layers (0 without them)."""
        return self.state_pool.slot_bytes if self.state_pool is not None else 0

    # ---- lifecycle / IPC ----------------------------------------------------------------

    def exit(self) -> None:
        """Give back everything this runner holds (graphs, KV cache, weights, staging
        buffers, the allocator's cached blocks), then leave the process group. Safe twice."""
        self._release()
        if self.world_size > 1 and self.comm.group is not None:
            from hf_paged.distributed.process_group import destroy_process_group

            destroy_process_group(self.comm.group)
            # Drop it (with its store's and gloo's sockets) now: the layers share this
            # Communicator, and the model's reference cycles would keep it until a collection.
            self.comm.group = None

    def _release(self) -> None:
        """Drop every tensor this runner made. The graphs go first (their pool holds captured
        tensors and they read the KV cache), then the cache, the model (weights the engine
        loaded or fused; an in-memory HF model keeps its own), the sampler's generator, the
        backend's tensors and the pinned staging buffers; on CUDA the allocator's now unused
        blocks go back to the driver."""
        if self.graph_runner is not None:
            self.graph_runner.release()
            self.graph_runner = None
        if self.kv_cache is not None:
            self.kv_cache.release()
            self.kv_cache = None
        self.state_pool = None
        self.inputs.state_pool = None
        self.model = None
        self.lora = None
        self.sampler = None
        backend = getattr(self, "attn_backend", None)
        if backend is not None:
            backend.release()
        self.ctx = None
        self.inputs.release()
        self.memory.release()
