"""Triton attention backend: paged KV store, split-K paged decode, paged prefill.

Prefill reads K/V from the paged cache with our Triton kernel, also for pure prefill: on W1-like
prompts it is faster than torch's aten FlashAttention-2 varlen kernel on an H200
(evaluation/bench_kernels.py; figures in evaluation/results/RUNS.md). The aten kernel, which
reads the new K/V directly, is used for pure prefill (no cached tokens) on CUDA in fp16/bf16
when asked (``use_flash_prefill``) or when the block tables cannot cover the contexts (e.g. a
warm-up pass run before the KV cache exists). The decode path (store + paged decode) does no
host sync and sizes everything from tensor shapes, so it can be captured in a CUDA graph.

The kernels compute every spec the generic path records: score softcap (Gemma2), ALiBi
(Bloom, MPT; the slopes live in a small fp32 device tensor made once per spec and device),
attention sinks (GPT-OSS), V head dim != K head dim (MLA) and head dims that are not powers of
2, and bidirectional ranges (Gemma 3's images: prefill only, where they can hold a query).
``problem`` names what remains (head dims > 256, odd block sizes, other dtypes), so the
caller gives those layers the torch reference instead.
"""

from __future__ import annotations

import logging

import torch

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec, AttentionMetadata
from hf_paged.attention.torch_ref import TorchRefBackend
from hf_paged.kernels.attention.attention_common import MAX_HEAD_DIM
from hf_paged.kernels.attention.kv_store import store_kvcache
from hf_paged.kernels.attention.paged_decode import paged_decode
from hf_paged.kernels.attention.paged_prefill import paged_prefill

logger = logging.getLogger(__name__)


def _is_pure_prefill(meta: AttentionMetadata) -> bool:
    """True when every sequence's queries are all of its keys (nothing cached before them).

    Decided from the host copies only: without them we take the paged kernel, which is always
    correct, rather than sync the device.
    """
    if meta.cu_seqlens_q_cpu is None or meta.context_lens_cpu is None:
        return False
    cu = meta.cu_seqlens_q_cpu
    return all(ctx == cu[i + 1] - cu[i] for i, ctx in enumerate(meta.context_lens_cpu))


class TritonBackend(AttentionBackend):
    """Paged attention with Triton kernels (see module docstring). Safe in decode CUDA graphs.

    Args:
        use_flash_prefill: send pure prefill to ``aten._flash_attention_forward`` (CUDA,
            fp16/bf16) instead of the Triton paged kernel.
    """

    name = "triton"
    supports_cuda_graph = True
    accepts_stored_kv = True  # the fused rotary kernel writes K/V (one launch fewer per layer)
    accepts_sinks = True
    accepts_bidirectional = True

    def __init__(self, use_flash_prefill: bool = False) -> None:
        self.use_flash_prefill = use_flash_prefill  # prefer aten flash for pure prefill
        # None = not tried yet; False after the aten kernel failed once (then never again).
        self._flash_ok: bool | None = None
        # (slopes, device) -> [num_heads] fp32: made on first use (eager warm-up), then reused,
        # so a captured decode graph reads a tensor whose address never changes
        self._alibi: dict[tuple[tuple[float, ...], torch.device], torch.Tensor] = {}

    def release(self) -> None:
        self._alibi.clear()

    def problem(self, spec: AttentionLayerSpec, dtype: torch.dtype, block_size: int) -> str | None:
        """Why the Triton kernels cannot compute a layer of ``spec`` (None = they can): they
        take K and V head dims up to 256, power-of-2 KV blocks of >= 8 tokens, GQA groups of up
        to 64 query heads, fp16/bf16/fp32, and ALiBi slopes only one per query head."""
        for name, d in (("head_dim", spec.head_dim), ("head_dim_v", spec.v_head_dim)):
            if d > MAX_HEAD_DIM:
                return f"{name}={d} (the Triton kernels take head dims up to {MAX_HEAD_DIM})"
        slopes = spec.alibi_slopes
        if slopes is not None and len(slopes) != spec.num_heads:
            return f"{len(slopes)} ALiBi slopes for num_heads={spec.num_heads}"
        if block_size < 8 or block_size & (block_size - 1):
            return f"kv_block_size={block_size} (the Triton kernels need a power of 2 >= 8)"
        if spec.num_heads > 64 * spec.num_kv_heads:
            return f"GQA group of {spec.num_heads // spec.num_kv_heads} (the kernels take <= 64)"
        if spec.num_heads % spec.num_kv_heads:
            return f"num_heads={spec.num_heads} not a multiple of num_kv_heads={spec.num_kv_heads}"
        if dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return f"dtype={dtype}"
        return None

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor | None,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
        kv_stored: bool = False,
        sinks: torch.Tensor | None = None,  # [num_heads] sink logits (GPT-OSS's ``s_aux``)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim_v]
        if k_cache is None or v_cache is None:
            return self._forward_no_cache(q, k, v, meta, spec, sinks)
        if not kv_stored:
            store_kvcache(k, v, k_cache, v_cache, meta.slot_mapping)
        mods = dict(softcap=spec.softcap, alibi_slopes=self._alibi_slopes(spec, q.device),
                    sinks=sinks)  # fmt: skip
        if meta.is_decode:
            return paged_decode(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                spec.scale,
                spec.sliding_window,
                **mods,
            )
        key_ends = meta.query_key_ends if spec.bidirectional else None
        # host ints only: does the paged cache hold every key the queries need?
        cache_covers = (
            k_cache.numel() > 0
            and meta.block_tables.shape[1] * k_cache.shape[1] >= meta.max_context_len
        )
        if (self.use_flash_prefill or not cache_covers) and self._flash_usable(q, spec, sinks):
            if _is_pure_prefill(meta) and key_ends is None:
                out = self._flash_prefill(q, k, v, meta, spec)
                if out is not None:
                    return out
        if not cache_covers:
            raise ValueError(
                f"block_tables ({meta.block_tables.shape[1]} blocks of {k_cache.shape[1]}) or an "
                f"empty cache cannot hold max_context_len={meta.max_context_len}"
            )
        return paged_prefill(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            meta.max_seqlen_q,
            spec.scale,
            spec.sliding_window,
            query_key_ends=key_ends,
            **mods,
        )

    def _alibi_slopes(self, spec: AttentionLayerSpec, device: torch.device) -> torch.Tensor | None:
        """The layer's ALiBi slopes as a [num_heads] fp32 tensor on ``device``, made once."""
        if spec.alibi_slopes is None:
            return None
        key = (spec.alibi_slopes, device)
        if key not in self._alibi:
            self._alibi[key] = torch.tensor(spec.alibi_slopes, dtype=torch.float32, device=device)
        return self._alibi[key]

    def _forward_no_cache(self, q, k, v, meta, spec, sinks) -> torch.Tensor:
        """No KV cache yet (a profile pass): whole prompts only, through aten flash attention
        when it takes the inputs, else the torch reference."""
        causal = meta.query_key_ends is None or not spec.bidirectional
        if self._flash_usable(q, spec, sinks) and _is_pure_prefill(meta) and causal:
            out = self._flash_prefill(q, k, v, meta, spec)
            if out is not None:
                return out
        return TorchRefBackend().forward(q, k, v, None, None, meta, spec, sinks=sinks)

    def _flash_usable(self, q: torch.Tensor, spec: AttentionLayerSpec, sinks) -> bool:
        """aten flash attention has no score modifiers and needs V's head dim equal to K's."""
        plain = spec.softcap is None and spec.alibi_slopes is None and sinks is None
        return (
            plain
            and spec.v_head_dim == spec.head_dim
            and self._flash_ok is not False
            and q.is_cuda
            and q.dtype in (torch.float16, torch.bfloat16)
            and q.shape[-1] % 8 == 0
            and q.shape[-1] <= 256
            and hasattr(torch.ops.aten, "_flash_attention_forward")
        )

    def _flash_prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionLayerSpec,
    ) -> torch.Tensor | None:
        """Varlen causal FlashAttention over the new tokens; None if the op refuses the call."""
        window = spec.sliding_window
        try:
            out = torch.ops.aten._flash_attention_forward(
                q,
                k,
                v,
                meta.cu_seqlens_q,
                meta.cu_seqlens_q,  # keys = the new tokens themselves
                meta.max_seqlen_q,
                meta.max_seqlen_q,
                0.0,  # dropout_p
                True,  # is_causal
                False,  # return_debug_mask
                scale=spec.scale,
                # flash-attn sees key j iff i - left <= j <= i + right; ours is i - j < window
                window_size_left=window - 1 if window is not None else -1,
                window_size_right=0 if window is not None else -1,
            )[0]
        except (RuntimeError, TypeError) as exc:
            logger.warning("aten flash attention unusable (%s); using the Triton prefill", exc)
            self._flash_ok = False
            return None
        self._flash_ok = True
        return out
