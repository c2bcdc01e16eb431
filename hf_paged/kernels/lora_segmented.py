"""Segmented LoRA (Punica-style shrink and expand): ``out[t] += scale[s] * (x[t] @ A[s].T) @ B[s].T``
for each token ``t`` whose adapter slot is ``s`` (no adapter: slot -1, nothing added).

Layout (vLLM's ``lora/ops/triton_ops``): one adapter slice's weights are stacked per slot,
``A [S, R, K]`` and ``B [S, N, R]`` with ranks below ``R`` zero-padded. The step's tokens are
grouped by slot once (``LoraSegments``: token indices sorted by slot, then per segment its start,
length and slot), and every kernel program handles ``BLOCK_M`` tokens of one segment:

* shrink: ``y[t, :] = x[t] @ A[s].T`` into an fp32 buffer ``[T, R]``;
* expand: ``out[t, off:off + N] += scale[s] * y[t] @ B[s].T`` with ``y`` rounded to the adapter's
  dtype first (as PEFT's ``lora_B(lora_A(x))``), accumulated in fp32, rounded once to ``out``'s
  dtype. Products run in the inputs' dtype (fp32 inputs without TF32).

The grid is sized by ``T`` (every segment gets ``cdiv(T, BLOCK_M)`` row programs; those past the
segment's end return at once), so no launch argument depends on the step's slot counts.
``lora_ref`` is the torch reference (and the CPU path): the same sums per segment with matmuls.
A fused projection (q/k/v, gate/up) calls expand once per slice with its column offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class LoraSegments:
    """A step's tokens grouped by adapter slot (slot -1: no adapter, never a segment)."""

    token_indices: torch.Tensor  # [T_lora] int32/int64: tokens with an adapter, sorted by slot
    seg_starts: torch.Tensor  # [G] int32: offset of each segment in ``token_indices``
    seg_lens: torch.Tensor  # [G] int32: tokens in each segment (0: an empty segment)
    seg_slots: torch.Tensor  # [G] int32: each segment's slot (-1: skipped)
    num_tokens: int  # T, the step's token count (sizes the grid)
    # host copies for the torch path: (slot, first, last) into token_indices
    host: tuple[tuple[int, int, int], ...] = ()

    @classmethod
    def from_slots(cls, token_slots: list[int], device) -> LoraSegments:
        """Group ``token_slots`` (one slot per token, -1 = none) on the host; one copy each."""
        order = sorted((s, t) for t, s in enumerate(token_slots) if s >= 0)
        idx = [t for _, t in order]
        starts, lens, slots, host = [], [], [], []
        i = 0
        while i < len(order):
            s, j = order[i][0], i
            while j < len(order) and order[j][0] == s:
                j += 1
            starts.append(i), lens.append(j - i), slots.append(s), host.append((s, i, j))
            i = j
        as_t = lambda v, dt: torch.tensor(v, dtype=dt).to(device)  # noqa: E731
        return cls(as_t(idx, torch.int64), as_t(starts, torch.int32), as_t(lens, torch.int32),
                   as_t(slots, torch.int32), len(token_slots), tuple(host))  # fmt: skip


def lora_ref(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             scales: torch.Tensor, segs: LoraSegments, offset: int = 0) -> None:  # fmt: skip
    """Torch reference, in place: for each segment ``(slot s, tokens idx)``,
    ``out[idx, offset:offset + N] += ((x[idx] @ A[s].T) @ B[s].T) * scale[s]`` in ``x``'s dtype,
    as PEFT's ``lora_B(lora_A(x)) * scaling``.

    Shapes: x [T, K], out [T, >= offset + N], a [S, R, K], b [S, N, R], scales [S].
    """
    n = b.shape[1]
    for slot, first, last in segs.host:
        if slot < 0 or last == first:
            continue
        idx = segs.token_indices[first:last]
        delta = (x[idx] @ a[slot].T) @ b[slot].T * scales[slot]
        out[idx, offset : offset + n] += delta.to(out.dtype)


def lora_triton(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scales: torch.Tensor, segs: LoraSegments, offset: int = 0,
                block_m: int = 16) -> None:  # fmt: skip
    """``lora_ref`` with the Triton shrink and expand kernels (same arguments)."""
    t, k = x.shape
    num_segs, r, n = segs.seg_slots.numel(), a.shape[1], b.shape[1]
    if num_segs == 0 or t == 0:
        return
    if a.shape[2] != k or b.shape[2] != r or a.shape[0] != b.shape[0]:
        raise ValueError(f"lora shapes disagree: x {tuple(x.shape)}, A {tuple(a.shape)}, "
                         f"B {tuple(b.shape)}")  # fmt: skip
    x = x.contiguous()
    if a.stride(2) != 1:  # a view of stacked slices is fine: the kernel takes its strides
        a = a.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    y = torch.zeros(t, r, dtype=torch.float32, device=x.device)  # [T, R]
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32: no TF32 rounding
    block_r = max(16, triton.next_power_of_2(r))
    m_blocks = triton.cdiv(t, block_m)
    _shrink_kernel[(m_blocks, num_segs)](
        x, a, y, segs.token_indices, segs.seg_starts, segs.seg_lens, segs.seg_slots,
        k, r, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=64, PRECISION=precision,
    )  # fmt: skip
    block_n = 64
    _expand_kernel[(m_blocks, triton.cdiv(n, block_n), num_segs)](
        y, b, scales, out, segs.token_indices, segs.seg_starts, segs.seg_lens, segs.seg_slots,
        n, r, offset, y.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r, PRECISION=precision,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _block_rows(idx_ptr, starts_ptr, lens_ptr, slots_ptr, SEG_AXIS: tl.constexpr,
                    BLOCK_M: tl.constexpr):  # fmt: skip
        """Both kernels' prologue, for a program of row block ``program_id(0)`` in segment
        ``program_id(SEG_AXIS)``: the segment's adapter slot, whether the block is idle (no
        adapter, or past the segment's end), and its token rows [BLOCK_M] with their mask. A
        segment without an adapter counts as empty, so it reads no rows."""
        pid_m = tl.program_id(0)
        seg = tl.program_id(SEG_AXIS)
        slot = tl.load(slots_ptr + seg)
        seg_len = tl.where(slot < 0, 0, tl.load(lens_ptr + seg))
        m0 = pid_m * BLOCK_M
        rm = m0 + tl.arange(0, BLOCK_M)
        m_mask = rm < seg_len
        rows = tl.load(idx_ptr + tl.load(starts_ptr + seg) + rm, mask=m_mask, other=0)
        return slot, m0 >= seg_len, rows, m_mask

    @triton.jit
    def _shrink_kernel(x_ptr, a_ptr, y_ptr, idx_ptr, starts_ptr, lens_ptr, slots_ptr,
                       K, R, stride_x, stride_as, stride_ar, stride_y,
                       BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                       PRECISION: tl.constexpr):  # fmt: skip
        slot, idle, rows, m_mask = _block_rows(idx_ptr, starts_ptr, lens_ptr, slots_ptr, 1, BLOCK_M)
        if idle:
            return
        rr = tl.arange(0, BLOCK_R)
        rk = tl.arange(0, BLOCK_K)
        r_mask = rr < R
        a_base = a_ptr + slot.to(tl.int64) * stride_as
        acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = (k0 + rk) < K
            xt = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + rk)[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
            at = tl.load(
                a_base + rr[:, None] * stride_ar + (k0 + rk)[None, :],
                mask=r_mask[:, None] & k_mask[None, :],
                other=0.0,
            )  # [BLOCK_R, BLOCK_K]
            acc = tl.dot(xt, tl.trans(at.to(xt.dtype)), acc, input_precision=PRECISION)
        tl.store(y_ptr + rows[:, None] * stride_y + rr[None, :], acc,
                 mask=m_mask[:, None] & r_mask[None, :])  # fmt: skip

    @triton.jit
    def _expand_kernel(y_ptr, b_ptr, scale_ptr, out_ptr, idx_ptr, starts_ptr, lens_ptr,
                       slots_ptr, N, R, OFFSET, stride_y, stride_bs, stride_bn, stride_o,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                       PRECISION: tl.constexpr):  # fmt: skip
        slot, idle, rows, m_mask = _block_rows(idx_ptr, starts_ptr, lens_ptr, slots_ptr, 2, BLOCK_M)
        if idle:
            return
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        n_mask = rn < N
        r_mask = rr < R
        yt = tl.load(
            y_ptr + rows[:, None] * stride_y + rr[None, :],
            mask=m_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_R]
        bt = tl.load(
            b_ptr + slot.to(tl.int64) * stride_bs + rn[:, None] * stride_bn + rr[None, :],
            mask=n_mask[:, None] & r_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_R]
        # A(x) rounded to the adapter's dtype before B, as PEFT's lora_B(lora_A(x)) computes it
        acc = tl.dot(yt.to(bt.dtype), tl.trans(bt), input_precision=PRECISION)
        acc = acc * tl.load(scale_ptr + slot).to(tl.float32)
        o_ptrs = out_ptr + rows[:, None] * stride_o + OFFSET + rn[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        prev = tl.load(o_ptrs, mask=mask, other=0.0)
        tl.store(o_ptrs, (prev.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor) -> bool:
    """Whether ``segmented_lora`` takes the Triton kernels: triton installed, CUDA inputs."""
    return triton is not None and x.is_cuda


def segmented_lora(x, out, a, b, scales, segs: LoraSegments, offset: int = 0) -> None:
    """The LoRA add of one slice: the Triton kernels on CUDA, else the torch reference."""
    if supports(x):
        lora_triton(x, out, a, b, scales, segs, offset)
    else:
        lora_ref(x, out, a, b, scales, segs, offset)
