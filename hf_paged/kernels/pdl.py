"""Programmatic dependent launch (PDL, Hopper and later), on by default; ``HF_PAGED_PDL=0`` off
(``hf_paged/envs.py``).

A kernel launched with PDL may start while the kernel before it on the stream is still running;
it must not touch memory the earlier kernel writes until ``griddepcontrol.wait`` returns. Each
kernel here calls :func:`pdl_enter` first: it waits for the previous grid (so every load and
store after it is ordered exactly as without PDL) and then lets the next PDL-launched grid be
scheduled. What overlaps is the next kernel's launch and CTA set-up with this kernel's tail,
which at decode batch 1 (~350 short kernels per step) is a measurable share of the step.

Before the wait a kernel may read only what the kernel right before it does not write: every
kernel waits before it releases the next, so all grids before the one right before this one
have finished when this one starts. The skinny GEMM loads its first weight tile there; paged
decode and its reduce read the context length (written by the step's metadata copy).
``HF_PAGED_PDL_PREFETCH=0`` makes the skinny GEMM wait before its first tile too.

Needs Triton with ``launch_pdl`` and ``tl.extra.cuda.gdc_wait``, and a device of compute
capability 9.0 or later; otherwise kernels launch without PDL. CUDA graphs keep the programmatic
edges (CUDA 12.3+).
"""

from __future__ import annotations

import functools

import torch

from hf_paged import envs

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


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
    return envs.HF_PAGED_PDL and t.is_cuda and _supported(t.device.index or 0)


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
