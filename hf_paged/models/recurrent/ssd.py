"""The Mamba 2 state-space recurrence (SSD) on a padded step, torch reference.

Per head ``h`` (``A`` a scalar per head, ``B``/``C`` shared by the heads of a group):
``state = exp(dt * A) * state + dt * x (outer) B`` (``[head_dim, d_state]``), ``y = state . C``.
``ssd_chunked`` computes it for whole chunks in blocks of ``chunk`` positions (quadratic inside
a block, the state carried across blocks), from each sequence's initial state; ``ssd_step``
is the single-token update of a decode. Both run in fp32 and return the final states; ``D``,
the gate and the norm are the mixer's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _segsum(a: torch.Tensor) -> torch.Tensor:
    """``a [..., c]`` -> ``[..., c, c]``: ``sum(a[j+1 .. i])`` at ``(i, j)`` for ``i >= j``, else
    ``-inf`` (a masked cumulative sum: no difference of two large cumsums)."""
    c = a.shape[-1]
    x = a[..., :, None].expand(*a.shape, c)  # [..., i, j] = a[i]
    below = torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device), diagonal=-1)
    s = torch.cumsum(x.masked_fill(~below, 0.0), dim=-2)
    keep = torch.tril(torch.ones(c, c, dtype=torch.bool, device=a.device))
    return s.masked_fill(~keep, float("-inf"))


def ssd_chunked(
    x: torch.Tensor,  # [N, L, H, P]
    dt: torch.Tensor,  # [N, L, H] fp32 after softplus; 0 past each chunk's end
    a: torch.Tensor,  # [H] fp32, -exp(A_log)
    b: torch.Tensor,  # [N, L, G, S]
    c: torch.Tensor,  # [N, L, G, S]
    h0: torch.Tensor,  # [N, H, P, S] fp32: the states before the chunks
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # y [N, L, H, P] fp32, the final states [N, H, P, S]
    n, length, heads, _ = x.shape
    rep = heads // b.shape[2]
    b = b.float().repeat_interleave(rep, dim=2)  # [N, L, H, S]
    c = c.float().repeat_interleave(rep, dim=2)
    xdt = x.float() * dt[..., None]  # [N, L, H, P]
    pad = -length % chunk
    if pad:
        xdt, b, c = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (xdt, b, c))
        dt = F.pad(dt, (0, 0, 0, pad))
    k = (length + pad) // chunk
    xdt, b, c = (t.reshape(n, k, chunk, heads, -1) for t in (xdt, b, c))  # [N, K, c, H, *]
    da = (dt * a).reshape(n, k, chunk, heads).permute(0, 3, 1, 2)  # [N, H, K, c]
    cum = torch.cumsum(da, dim=-1)
    # inside a block: y_i = sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j
    decay = torch.exp(_segsum(da))  # [N, H, K, i, j]
    scores = torch.einsum("nkihs,nkjhs->nhkij", c, b) * decay
    y = torch.einsum("nhkij,nkjhp->nkihp", scores, xdt)
    # each block's own contribution to the state at its end
    to_end = torch.exp(cum[..., -1:] - cum)  # [N, H, K, c]
    block_states = torch.einsum("nkjhs,nhkj,nkjhp->nkhps", b, to_end, xdt)
    # carry the state across blocks; y_i += (C_i . state at block start) exp(cum_i)
    h, starts = h0, []
    for i in range(k):
        starts.append(h)
        h = torch.exp(cum[:, :, i, -1])[..., None, None] * h + block_states[:, i]
    start = torch.stack(starts, dim=1)  # [N, K, H, P, S]
    y = (
        y
        + torch.einsum("nkihs,nkhps->nkihp", c, start)
        * torch.exp(cum).permute(0, 2, 3, 1)[..., None]
    )
    return y.reshape(n, k * chunk, heads, -1)[:, :length], h


def ssd_step(
    x: torch.Tensor,  # [N, H, P]: one token per sequence
    dt: torch.Tensor,  # [N, H] fp32
    a: torch.Tensor,  # [H] fp32
    b: torch.Tensor,  # [N, G, S]
    c: torch.Tensor,  # [N, G, S]
    h: torch.Tensor,  # [N, H, P, S] fp32
) -> tuple[torch.Tensor, torch.Tensor]:  # y [N, H, P] fp32, the new states
    rep = x.shape[1] // b.shape[1]
    b = b.float().repeat_interleave(rep, dim=1)[:, :, None, :]  # [N, H, 1, S]
    c = c.float().repeat_interleave(rep, dim=1)[..., None]  # [N, H, S, 1]
    dt4 = dt[..., None, None]
    h = h * torch.exp(dt4 * a[:, None, None]) + (dt4 * b) * x.float()[..., None]
    return torch.matmul(h, c)[..., 0], h
