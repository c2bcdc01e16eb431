"""Programmatic dependent launch (PDL, Hopper and later), on by default; ``HF_PAGED_PDL=0`` off.

A kernel launched with PDL may start while the kernel before it on the stream is still running;
it must not touch memory the earlier kernel writes until ``griddepcontrol.wait`` returns. Each
kernel here calls :func:`pdl_enter` first: it waits for the previous grid (so every load and
store after it is ordered exactly as without PDL) and then lets the next PDL-launched grid be
scheduled. What overlaps is the next kernel's launch and CTA set-up with this kernel's tail,
which at decode batch 1 (~350 short kernels per step) is a measurable share of the step.

Before the wait a kernel may read only what the kernel right before it does not write: each
kernel's own wait means every grid before that one has finished when this one starts. The
skinny GEMM loads its first weight tile there and asks L2 for the next few MB of weights
(:func:`prefetch_l2`); paged decode reads its context length and block table and asks L2 for
its first K/V tile (L2 is coherent, so a line the kernel before is still writing is fine to
prefetch; the loads that use it come after the wait).

Measured on one H200 (evaluation/bench_latency.py, L1, A/B by the variable in one call):
4.42 ms/token with PDL and the first-tile load, 4.50 without that load, 4.51 without PDL.
Needs Triton with ``launch_pdl`` and ``tl.extra.cuda.gdc_wait``, and a device of compute
capability 9.0 or later; otherwise kernels launch as before. CUDA graphs keep the programmatic
edges (CUDA 12.3+).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_REQUESTED = os.environ.get("HF_PAGED_PDL", "1") != "0"  # read once, at import
# L2 prefetch issued by a kernel before its wait, in bytes over the whole grid (0 = none)
PREFETCH_BYTES = int(float(os.environ.get("HF_PAGED_PDL_PREFETCH_MB", "8")) * 2**20)
L2_LINE = 128  # bytes


@functools.cache
def _supported(device_index: int) -> bool:
    if triton is None:
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        return (
            hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in CUDAOptions.__dataclass_fields__
            and torch.cuda.get_device_capability(device_index)[0] >= 9
        )
    except Exception:  # noqa: BLE001 - no CUDA backend: no PDL
        return False


def pdl_enabled(t: torch.Tensor) -> bool:
    """Whether kernels on ``t``'s device launch with PDL."""
    return _REQUESTED and t.is_cuda and _supported(t.device.index or 0)


def prefetch_lines(num_rows: int, row_bytes: int, skip_bytes: int = 0) -> int:
    """128-byte lines per row for :func:`prefetch_l2` over ``num_rows`` rows of ``row_bytes``
    each (``skip_bytes`` of each row are loaded anyway): a power of 2 (``tl.arange``), at
    least 1 and within the grid's :data:`PREFETCH_BYTES`; 0 when the budget is 0."""
    if PREFETCH_BYTES <= 0:
        return 0
    rest = max(0, row_bytes - skip_bytes) // L2_LINE
    lines = max(1, min(rest, PREFETCH_BYTES // (num_rows * L2_LINE)))
    return 1 << (lines.bit_length() - 1) if rest else 0


def pdl_kwargs(t: torch.Tensor) -> dict:
    """Launch keywords for a kernel taking a ``USE_PDL`` constexpr: PDL on where enabled."""
    return {"USE_PDL": True, "launch_pdl": True} if pdl_enabled(t) else {"USE_PDL": False}


if triton is not None:

    @triton.jit
    def pdl_enter(USE_PDL: tl.constexpr):
        """First statement of a kernel: wait for the previous grid, then release the next."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()

    @triton.jit
    def prefetch_l2(ptrs, mask, base_ptr):
        """Ask L2 for the 128-byte line of every pointer in ``ptrs`` where ``mask`` (the others
        are sent to ``base_ptr``, a valid address). A hint: no registers held, no ordering."""
        ptrs = tl.where(mask, ptrs, base_ptr)
        tl.inline_asm_elementwise(
            "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
            "=r,l",
            [ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
