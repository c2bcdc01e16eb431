"""Row-wise argmax over ``[B, V]`` logits in two short launches (Triton + torch reference).

torch reduces a few long rows with one thread block each: ``argmax`` of one Llama-3 row
(V = 128256) took 36 us on the H200 at batch 1, about 1% of a decode step. Here the grid is
``(B, cdiv(V, BLOCK))``: each program reduces one ``BLOCK`` chunk to (max, first index of the max,
first NaN index); a second launch reduces the chunks of each row.

Semantics are ``torch.argmax``'s: the first index of the maximum; a NaN counts as larger than
everything, so the first NaN wins; a row of ``-inf`` gives 0. No argument depends on data values,
so the launch is CUDA-graph safe.
"""

from __future__ import annotations

import torch

from hf_paged import envs
from hf_paged.kernels.pdl import pdl_kwargs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK = 4096  # columns per program in the first launch
_NONE = 2**31 - 1  # "no index" (no NaN in the chunk)


def _problem(logits: torch.Tensor) -> str | None:
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return f"logits must be a non-empty [B, V] tensor, got {tuple(logits.shape)}"
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"logits must be fp16, bf16 or fp32, got {logits.dtype}"
    if logits.shape[1] >= _NONE:
        return f"V={logits.shape[1]} does not fit int32 indices"
    return None


def supports(logits: torch.Tensor) -> bool:
    if not envs.HF_PAGED_ARGMAX or triton is None or not logits.is_cuda:
        return False
    return _problem(logits) is None


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (int64 [B]) with the kernels where they take ``logits``."""
    return _launch(logits) if supports(logits) else logits.argmax(dim=-1)


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _argmax_chunk_kernel(
        x_ptr, max_ptr, idx_ptr, nan_ptr, stride_x, V, NUM_CHUNKS: tl.constexpr,
        BLOCK: tl.constexpr, NONE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        cols = chunk * BLOCK + tl.arange(0, BLOCK)
        mask = cols < V
        x = tl.load(x_ptr + row.to(tl.int64) * stride_x + cols, mask=mask, other=float("-inf"))
        x = x.to(tl.float32)
        is_nan = x != x
        first_nan = tl.min(tl.where(is_nan & mask, cols, NONE), axis=0)
        x = tl.where(is_nan, float("-inf"), x)
        m = tl.max(x, axis=0)
        first = tl.min(tl.where((x == m) & mask, cols, NONE), axis=0)
        out = row * NUM_CHUNKS + chunk
        tl.store(max_ptr + out, m)
        tl.store(idx_ptr + out, first)
        tl.store(nan_ptr + out, first_nan)

    @triton.jit
    def _argmax_reduce_kernel(
        max_ptr, idx_ptr, nan_ptr, out_ptr, NUM_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
        NONE: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0)
        c = tl.arange(0, BLOCK_C)
        mask = c < NUM_CHUNKS
        base = row * NUM_CHUNKS
        m = tl.load(max_ptr + base + c, mask=mask, other=float("-inf"))
        idx = tl.load(idx_ptr + base + c, mask=mask, other=NONE)
        nan = tl.load(nan_ptr + base + c, mask=mask, other=NONE)
        best = tl.max(m, axis=0)
        # chunks hold increasing columns: the smallest index among the chunks at the max
        first = tl.min(tl.where(m == best, idx, NONE), axis=0)
        first_nan = tl.min(nan, axis=0)
        first = tl.where(first_nan < NONE, first_nan, first)
        first = tl.where(first == NONE, 0, first)  # every value -inf (then torch gives 0)
        tl.store(out_ptr + row, first.to(tl.int64))


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> int64 [B]
    """``logits.argmax(dim=-1)`` in two launches (see the module docstring).

    Raises:
        ValueError: ``logits`` is not a non-empty fp16/bf16/fp32 [B, V] tensor.
    """
    problem = _problem(logits)
    if problem is not None:
        raise ValueError(f"unsupported input for argmax: {problem}")
    return _launch(logits)


def _launch(logits: torch.Tensor) -> torch.Tensor:  # inputs already checked
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    b, v = logits.shape
    chunks = triton.cdiv(v, BLOCK)
    # one allocation per call for the per-chunk (max, index, first NaN) triples; each segment
    # 16-byte aligned, so Triton's pointer specialization does not change with the batch size
    seg = triton.cdiv(b * chunks, 4) * 4
    part = torch.empty(3, seg, dtype=torch.int32, device=logits.device)
    part_max, part_idx, part_nan = part[0].view(torch.float32), part[1], part[2]
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    _argmax_chunk_kernel[(b, chunks)](
        logits, part_max, part_idx, part_nan, logits.stride(0), v, NUM_CHUNKS=chunks,
        BLOCK=BLOCK, NONE=_NONE, num_warps=8,
        **pdl_kwargs(logits),
    )  # fmt: skip
    _argmax_reduce_kernel[(b,)](
        part_max, part_idx, part_nan, out, NUM_CHUNKS=chunks,
        BLOCK_C=max(triton.next_power_of_2(chunks), 2), NONE=_NONE, num_warps=1,
        **pdl_kwargs(logits),
    )  # fmt: skip
    return out
