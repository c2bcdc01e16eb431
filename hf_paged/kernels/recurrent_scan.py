"""Diagonal linear recurrences over a padded step ``[N, L, ...]`` (Triton kernels + torch
references): Mamba 1's selective scan and RG-LRU's linear scan.

* ``selective_scan``: ``h = exp(dt * A) * h + (dt * B) x``, ``y = h . C`` with a state
  ``[E, S]`` per sequence (``models/recurrent/mamba.py``);
* ``linear_scan``: ``h = a * h + x`` with a state ``[W]`` per sequence
  (``models/recurrent/rglru.py``).

Both walk the positions in order; the references launch a few ops per position, the kernels
one program per ``(sequence, block of channels)`` that keeps its states in registers for the
whole walk (grid ``(N, cdiv(channels, BLOCK))``). Everything accumulates in fp32; the returned
states are new tensors (the mixer writes them into its slots). No argument depends on values on
the device, so a decode-only step (``L == 1``) is CUDA-graph safe.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: only the references are usable
    triton = None


def selective_scan_ref(
    x: torch.Tensor,  # [N, L, E]
    dt: torch.Tensor,  # [N, L, E] fp32 (0 where the state must hold)
    a: torch.Tensor,  # [E, S] fp32
    b: torch.Tensor,  # [N, L, S]
    c: torch.Tensor,  # [N, L, S]
    h: torch.Tensor,  # [N, E, S] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # y [N, L, E] fp32, h after the walk [N, E, S]
    """Torch reference of :func:`selective_scan`."""
    ys = []
    for t in range(x.shape[1]):
        dt_t = dt[:, t, :, None]  # [N, E, 1]
        h = h * torch.exp(dt_t * a) + (dt_t * b[:, t, None, :].float()) * x[:, t, :, None].float()
        ys.append(torch.matmul(h, c[:, t, :, None].float())[..., 0])  # [N, E]
    return torch.stack(ys, dim=1), h


def linear_scan_ref(
    a: torch.Tensor,  # [N, L, W]
    x: torch.Tensor,  # [N, L, W]
    h: torch.Tensor,  # [N, W] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # every position's state [N, L, W] fp32, the last
    """Torch reference of :func:`linear_scan`."""
    out = []
    for t in range(x.shape[1]):
        h = a[:, t].float() * h + x[:, t].float()
        out.append(h)
    return torch.stack(out, dim=1), h


def supports(*tensors: torch.Tensor) -> bool:
    """Whether to dispatch to the Triton kernels: triton installed and CUDA tensors."""
    return triton is not None and all(t.is_cuda for t in tensors)


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


if triton is not None:

    @triton.jit
    def _selective_scan_kernel(
        x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, h_ptr, y_ptr, h_out_ptr,
        length, channels, d_state,
        sx_n, sx_l, sdt_n, sdt_l, sb_n, sb_l, sc_n, sc_l, sy_n, sy_l,
        BLOCK_E: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        s = tl.arange(0, BLOCK_S)
        me, ms = e < channels, s < d_state
        m2 = me[:, None] & ms[None, :]
        es = e[:, None] * d_state + s[None, :]  # [E, S] offsets of a (and of h in a sequence)
        a = tl.load(a_ptr + es, mask=m2, other=0.0)
        h = tl.load(h_ptr + n * channels * d_state + es, mask=m2, other=0.0)
        for t in range(length):
            x = tl.load(x_ptr + n * sx_n + t * sx_l + e, mask=me, other=0.0).to(tl.float32)
            dt = tl.load(dt_ptr + n * sdt_n + t * sdt_l + e, mask=me, other=0.0)
            b = tl.load(b_ptr + n * sb_n + t * sb_l + s, mask=ms, other=0.0).to(tl.float32)
            c = tl.load(c_ptr + n * sc_n + t * sc_l + s, mask=ms, other=0.0).to(tl.float32)
            h = h * tl.exp(dt[:, None] * a) + (dt[:, None] * b[None, :]) * x[:, None]
            y = tl.sum(h * c[None, :], axis=1)
            tl.store(y_ptr + n * sy_n + t * sy_l + e, y, mask=me)
        tl.store(h_out_ptr + n * channels * d_state + es, h, mask=m2)

    @triton.jit
    def _linear_scan_kernel(
        a_ptr, x_ptr, h_ptr, out_ptr, h_out_ptr,
        length, width, sa_n, sa_l, sx_n, sx_l, so_n, so_l,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0).to(tl.int64)
        w = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mw = w < width
        h = tl.load(h_ptr + n * width + w, mask=mw, other=0.0)
        for t in range(length):
            a = tl.load(a_ptr + n * sa_n + t * sa_l + w, mask=mw, other=0.0).to(tl.float32)
            x = tl.load(x_ptr + n * sx_n + t * sx_l + w, mask=mw, other=0.0).to(tl.float32)
            h = a * h + x
            tl.store(out_ptr + n * so_n + t * so_l + w, h, mask=mw)
        tl.store(h_out_ptr + n * width + w, h, mask=mw)


def selective_scan(x, dt, a, b, c, h) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba 1's scan (shapes as :func:`selective_scan_ref`): the kernel on CUDA, else the
    reference."""
    if supports(x, dt, a, b, c, h):
        return selective_scan_triton(x, dt, a, b, c, h)
    return selective_scan_ref(x, dt, a, b, c, h)


def linear_scan(a, x, h) -> tuple[torch.Tensor, torch.Tensor]:
    """RG-LRU's scan (shapes as :func:`linear_scan_ref`): the kernel on CUDA, else the
    reference."""
    if supports(a, x, h):
        return linear_scan_triton(a, x, h)
    return linear_scan_ref(a, x, h)


def selective_scan_triton(x, dt, a, b, c, h) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launch of :func:`selective_scan` (any device under ``TRITON_INTERPRET=1``)."""
    x, b, c = _unit_last(x), _unit_last(b), _unit_last(c)
    n, length, channels = x.shape
    d_state = a.shape[1]
    dt, a, h = dt.float().contiguous(), a.float().contiguous(), h.float().contiguous()
    y = torch.empty(n, length, channels, device=x.device, dtype=torch.float32)
    h_out = torch.empty_like(h)
    block_s = triton.next_power_of_2(d_state)
    block_e = max(16, min(128, 2048 // block_s))
    grid = (n, triton.cdiv(channels, block_e))
    _selective_scan_kernel[grid](
        x, dt, a, b, c, h, y, h_out, length, channels, d_state,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), b.stride(0), b.stride(1),
        c.stride(0), c.stride(1), y.stride(0), y.stride(1),
        BLOCK_E=block_e, BLOCK_S=block_s, num_warps=4,
    )  # fmt: skip
    return y, h_out


def linear_scan_triton(a, x, h) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton launch of :func:`linear_scan` (any device under ``TRITON_INTERPRET=1``)."""
    a, x = _unit_last(a), _unit_last(x)
    n, length, width = x.shape
    h = h.float().contiguous()
    out = torch.empty(n, length, width, device=x.device, dtype=torch.float32)
    h_out = torch.empty_like(h)
    block = 256
    grid = (n, triton.cdiv(width, block))
    _linear_scan_kernel[grid](
        a, x, h, out, h_out, length, width,
        a.stride(0), a.stride(1), x.stride(0), x.stride(1), out.stride(0), out.stride(1),
        BLOCK=block, num_warps=4,
    )  # fmt: skip
    return out, h_out
