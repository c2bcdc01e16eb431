"""Per-token LoRA (Punica's "bgmv", a gathered matrix-vector product per token):
``out[t, off:off + N] += scale[s] * (x[t] @ A[s].T) @ B[s].T`` where ``s = token_slots[t]``, and
nothing for ``s = -1`` (no adapter).

Each token reads its own slot's factors; there are no host-side segments. The slot of every
token is one device tensor, so a decode step's LoRA is graph-capturable: a CUDA graph captured
once per batch size replays with whatever slots the tokens carry (the graph's static slot buffer
is rewritten before each replay, padded rows -1). Prefill keeps the segmented kernels
(``lora_segmented.py``), whose tiles reuse each factor over a segment's tokens.

Layout as ``lora_segmented``: ``A [S, R, K]``, ``B [S, N, R]`` (ranks below ``R`` zero-padded,
views of a fused layer's stacks allowed: the kernels take strides), ``scales [S]``.

* shrink: ``SPLIT`` programs per token, each a fixed range of ``K``, write fp32 partial sums
  ``[T, SPLIT, R]`` (no atomics: the same inputs give the same bits, eager or replayed). ``SPLIT``
  depends on ``K`` only, never on the batch size, so a graph's padded batch and an eager step sum
  in the same order.
* expand: per token and ``BLOCK_N`` columns, the partials summed in order, rounded to the
  adapter's dtype (PEFT's ``lora_B(lora_A(x))`` rounds there), times ``B[s]``, accumulated in
  fp32, scaled, added to ``out`` and rounded once to ``out``'s dtype.

``lora_per_token_ref`` is the torch reference (every token against its gathered factors, rows
without an adapter masked to exact zeros): no host sync either.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_BLOCK_K = 64  # the shrink's K tile
_K_PER_SPLIT = 256  # about this much of K per shrink program
_MAX_SPLIT = 16
_BLOCK_N = 64  # the expand's output tile


def lora_per_token_ref(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       scales: torch.Tensor, token_slots: torch.Tensor,
                       offset: int = 0) -> None:  # fmt: skip
    """Torch reference, in place: ``out[t, offset:offset + N] += ((x[t] @ A[s].T) @ B[s].T) *
    scale[s]`` in ``x``'s dtype for every token ``t`` with slot ``s >= 0``.

    Shapes: x [T, K], out [T, >= offset + N], a [S, R, K], b [S, N, R], scales [S],
    token_slots [T] (int, -1: no adapter).
    """
    n = b.shape[1]
    live = token_slots >= 0
    s = token_slots.clamp(min=0).long()
    y = torch.einsum("tk,trk->tr", x, a[s].to(x.dtype))  # [T, R]
    delta = torch.einsum("tr,tnr->tn", y.to(b.dtype), b[s]) * scales[s][:, None]  # [T, N]
    delta = torch.where(live[:, None], delta, torch.zeros((), dtype=delta.dtype, device=x.device))
    out[:, offset : offset + n] += delta.to(out.dtype)


def split_of(k: int) -> int:
    """Shrink programs per token for an input width ``k`` (a power of two; ``k`` only)."""
    return min(_MAX_SPLIT, triton.next_power_of_2(triton.cdiv(k, _K_PER_SPLIT)))


def lora_per_token_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                          scales: torch.Tensor, token_slots: torch.Tensor,
                          offset: int = 0) -> None:  # fmt: skip
    """``lora_per_token_ref`` with the Triton shrink and expand kernels (same arguments). Launch
    arguments depend on shapes only (no host sync), so a CUDA graph can capture it."""
    t, k = x.shape
    r, n = a.shape[1], b.shape[1]
    if t == 0:
        return
    if a.shape[2] != k or b.shape[2] != r or a.shape[0] != b.shape[0] or token_slots.shape[0] != t:
        raise ValueError(f"lora shapes disagree: x {tuple(x.shape)}, A {tuple(a.shape)}, "
                         f"B {tuple(b.shape)}, token_slots {tuple(token_slots.shape)}")  # fmt: skip
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(2) != 1:
        a = a.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    split = split_of(k)
    k_per_split = triton.cdiv(triton.cdiv(k, split), _BLOCK_K) * _BLOCK_K
    block_r = max(16, triton.next_power_of_2(r))
    part = torch.empty(t, split, r, dtype=torch.float32, device=x.device)  # [T, SPLIT, R]
    _shrink_kernel[(t, split)](
        x, a, part, token_slots, k, r, k_per_split, x.stride(0), a.stride(0), a.stride(1),
        part.stride(0), part.stride(1), BLOCK_R=block_r, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(t, triton.cdiv(n, _BLOCK_N))](
        part, b, scales, out, token_slots, n, r, offset, part.stride(0), part.stride(1),
        b.stride(0), b.stride(1), out.stride(0),
        SPLIT=split, BLOCK_N=_BLOCK_N, BLOCK_R=block_r,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _token_rank(slots_ptr, R, BLOCK_R: tl.constexpr):
        """Both kernels' prologue: this program's token, its adapter slot (-1: none) and the
        rank lanes [BLOCK_R] with their mask."""
        tok = tl.program_id(0)
        rr = tl.arange(0, BLOCK_R)
        return tok, tl.load(slots_ptr + tok), rr, rr < R

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, part_ptr, slots_ptr, K, R, K_PER_SPLIT,
                       stride_x, stride_as, stride_ar, stride_pt, stride_ps,
                       BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
        tok, slot, rr, r_mask = _token_rank(slots_ptr, R, BLOCK_R)
        if slot < 0:
            return
        sp = tl.program_id(1)
        rk = tl.arange(0, BLOCK_K)
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        x_base = x_ptr + tok.to(tl.int64) * stride_x
        acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
        k_lo = sp * K_PER_SPLIT
        for k0 in range(k_lo, k_lo + K_PER_SPLIT, BLOCK_K):
            kk = k0 + rk
            k_mask = kk < K
            xv = tl.load(x_base + kk, mask=k_mask, other=0.0).to(tl.float32)  # [BLOCK_K]
            av = tl.load(a_base + rr[:, None] * stride_ar + kk[None, :],
                         mask=r_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            acc += tl.sum(av.to(tl.float32) * xv[None, :], axis=1)  # [BLOCK_R]
        tl.store(part_ptr + tok.to(tl.int64) * stride_pt + sp * stride_ps + rr, acc, mask=r_mask)

    @triton.jit
    def _expand_kernel(part_ptr, b_ptr, scale_ptr, out_ptr, slots_ptr, N, R, OFFSET,
                       stride_pt, stride_ps, stride_bs, stride_bn, stride_o,
                       SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr):  # fmt: skip
        tok, slot, rr, r_mask = _token_rank(slots_ptr, R, BLOCK_R)
        if slot < 0:
            return
        rs = tl.arange(0, SPLIT)
        parts = tl.load(part_ptr + tok.to(tl.int64) * stride_pt + rs[:, None] * stride_ps
                        + rr[None, :], mask=r_mask[None, :], other=0.0)  # fmt: skip
        y = tl.sum(parts, axis=0)  # [BLOCK_R]
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
        bv = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn + rr[None, :],
                     mask=n_mask[:, None] & r_mask[None, :], other=0.0)  # fmt: skip
        # A(x) rounded to the adapter's dtype before B, as PEFT's lora_B(lora_A(x)) computes it
        y = y.to(bv.dtype).to(tl.float32)
        acc = tl.sum(bv.to(tl.float32) * y[None, :], axis=1)  # [BLOCK_N]
        acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
        o_ptrs = out_ptr + tok.to(tl.int64) * stride_o + OFFSET + rn
        prev = tl.load(o_ptrs, mask=n_mask, other=0.0)
        tl.store(o_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=n_mask)


def supports(x: torch.Tensor) -> bool:
    """Whether ``lora_per_token`` takes the Triton kernels: triton installed, CUDA inputs."""
    return triton is not None and x.is_cuda


def available(device) -> bool:
    """Whether an engine on ``device`` runs its decode LoRA through the Triton kernels (and so
    can capture it in CUDA graphs)."""
    return triton is not None and torch.device(device).type == "cuda"


def lora_per_token(x, out, a, b, scales, token_slots, offset: int = 0) -> None:
    """The per-token LoRA add of one slice: the Triton kernels on CUDA, else the reference."""
    if supports(x):
        lora_per_token_triton(x, out, a, b, scales, token_slots, offset)
    else:
        lora_per_token_ref(x, out, a, b, scales, token_slots, offset)
