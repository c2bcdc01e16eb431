"""Decode CUDA graphs: one graph per batch size (1, 2, 4, 8, then every multiple of 16 up to
max_num_seqs, plus max_num_seqs itself), all writing into shared static buffers. A decode step of
n sequences replays the smallest graph of size >= n; rows past n are padding (slot -1).
The runner's ``KVCache`` goes into the captured metadata, so the graphs read and write the same
cache tensors the eager steps use (it must outlive the graphs); so does a recurrent model's
state pool, with persistent state-slot buffers whose padded rows point at the dummy slot 0.
With LoRA slots the graphs capture the per-token LoRA kernels reading a static slot buffer (one
int32 per row, -1: no adapter, padded rows -1), rewritten before each replay from the step's
``LoraStep.decode_slots``: one graph per batch size serves every adapter mix, and adapters
written into the slots later are read in place."""

from __future__ import annotations

import torch

from hf_paged.attention import AttentionMetadata
from hf_paged.refusal import Refusal


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sizes


class DecodeGraphRunner:
    def __init__(self, runner):
        self.runner = runner
        self.sizes = graph_batch_sizes(runner.config.max_num_seqs)
        max_bs = self.sizes[-1]
        dev = runner.device
        self.max_blocks = -(-runner.max_model_len // runner.block_size)
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=dev)
        self.context_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=dev)
        self.cu_seqlens_q = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.state_pool = runner.state_pool  # None without recurrent layers
        self.state_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.has_initial_state = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        self.lora = runner.lora  # None without LoRA slots
        self.lora_slots = None
        if self.lora is not None:
            self.lora_slots = torch.full((max_bs,), -1, dtype=torch.int32, device=dev)
        self.outputs: torch.Tensor | None = None  # [max_bs, H], sized by the first forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.capture()

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            is_decode=True, num_seqs=bs, slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1], context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs], max_seqlen_q=1,
            max_context_len=self.runner.max_model_len, kv_cache=self.runner.kv_cache,
            **self._state_fields(bs),
        )  # fmt: skip

    def _state_fields(self, bs: int) -> dict:
        if self.state_pool is None:
            return {}
        return dict(state_indices=self.state_indices[:bs],
                    has_initial_state=self.has_initial_state[:bs],
                    recurrent_states=self.state_pool.layers)  # fmt: skip

    @torch.inference_mode()
    def capture(self) -> None:
        model = self.runner.model
        for bs in reversed(self.sizes):  # largest first: later graphs reuse its pool
            meta = self._meta(bs)
            args = (self.input_ids[:bs], self.positions[:bs], meta)
            if self.lora is not None:  # the layers read the static slots (all -1 now)
                self.lora.step.decode_slots = self.lora_slots[:bs]
            hidden = model(*args)  # warm up (kernel autotuning, allocations)
            if self.outputs is None:
                self.outputs = hidden.new_zeros(self.sizes[-1], *hidden.shape[1:])
            self.outputs[:bs] = hidden
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, self.pool):
                self.outputs[:bs] = model(*args)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
            torch.cuda.synchronize()
        if self.lora is not None:
            self.lora.finish()

    def fits(self, meta: AttentionMetadata) -> bool:
        if self.lora is not None and self.lora.step.segments is not None:
            return False  # adapters grouped on the host: not what the graphs captured
        return meta.num_seqs <= self.sizes[-1] and meta.block_tables.shape[1] <= self.max_blocks

    def replay(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        n = meta.num_seqs
        bs = next(b for b in self.sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bs] = 1
        self.block_tables[:n, : meta.block_tables.shape[1]] = meta.block_tables
        if self.state_pool is not None:
            self.state_indices[:n] = meta.state_indices
            self.state_indices[n:bs] = 0  # the dummy slot
            self.has_initial_state[:n] = meta.has_initial_state
        if self.lora_slots is not None:
            slots = self.lora.step.decode_slots  # None: no row has an adapter
            if slots is None:
                self.lora_slots[:bs] = -1
            else:
                self.lora_slots[:n] = slots
                self.lora_slots[n:bs] = -1
        self.graphs[bs].replay()
        return self.outputs[:n]

    def release(self) -> None:
        """Free the graphs (their private pool returns to the allocator once the last one is
        reset), the static buffers, and the references to the runner and its KV cache."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.pool = None
        self.outputs = None
        self.input_ids = self.positions = self.slot_mapping = None
        self.context_lens = self.block_tables = self.cu_seqlens_q = None
        self.state_pool = self.state_indices = self.has_initial_state = None
        self.lora = self.lora_slots = None
        self.runner = None


def eager_refusal(config, model, attn_backend, ctx, lora=None) -> Refusal | None:
    """Why a runner's decode will run eagerly (None = it is captured, on CUDA): the engine's
    ``config``, its ``model``, attention backend, ``ModelContext`` and LoRA slots say so."""
    if config.enforce_eager:
        return Refusal("cuda_graph", "enforce_eager=True")
    if lora is not None and not lora.per_token:
        return Refusal(
            "cuda_graph",
            "LoRA slots without the per-token Triton kernels (they need CUDA and triton): "
            "each step's token-to-slot grouping is built on the host",
        )
    if not getattr(model, "supports_cuda_graph", False):
        why = getattr(model, "cuda_graph_reason", None) or "the model says so"
        return Refusal("cuda_graph", f"{type(model).__name__} does not support CUDA graphs: {why}")
    if not attn_backend.supports_cuda_graph:
        return Refusal(
            "cuda_graph",
            f"the {attn_backend.name!r} attention backend is not CUDA-graph safe",
        )
    if ctx.fallbacks:
        return Refusal(
            "cuda_graph",
            f"layers {sorted(ctx.fallbacks)} use the torch reference attention",
        )
    return None
