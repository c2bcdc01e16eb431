"""The gated delta rule in torch, on the engine's flattened varlen layout (fp32 throughout).

Per head, with ``S`` the ``[K, V]`` state, a token ``(q, k, v, g, beta)`` does::

    S <- exp(g) * S
    S <- S + k (beta * (v - k^T S))^T          # the delta rule: correct what S predicts for k
    o  = S^T q

``q`` and ``k`` arrive l2-normalized; ``q`` carries the ``1/sqrt(K)`` scale. Two forms:

* ``delta_rule_step``: one token per sequence (decode), in place on slot-indexed states, with no
  host reads (CUDA-graph safe).
* ``delta_rule_chunked``: sequences of any length, cut into chunks of ``chunk`` tokens; within a
  chunk the updates are condensed into triangular solves (the WY / UT form), across chunks a
  scan carries ``S``. The chunks of all sequences are batched: scan step ``j`` runs the ``j``-th
  chunk of every sequence that has one.

This is the CPU path and the oracle the CUDA kernels are tested against.
"""

from __future__ import annotations

import torch

CHUNK = 64  # as transformers' torch reference and fla


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's and transformers' convention)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor,  # [N, H, K] fp32, normalized and scaled
    k: torch.Tensor,  # [N, H, K] fp32, normalized
    v: torch.Tensor,  # [N, H, V] fp32
    g: torch.Tensor,  # [N, H] fp32 log decay (<= 0)
    beta: torch.Tensor,  # [N, H] fp32
    state: torch.Tensor,  # [N, H, K, V] fp32: the states before the token
) -> tuple[torch.Tensor, torch.Tensor]:  # o [N, H, V], new state [N, H, K, V]
    s = state * g.exp()[..., None, None]
    pred = (s * k[..., None]).sum(dim=-2)  # k^T S: [N, H, V]
    delta = (v - pred) * beta[..., None]
    s = s + k[..., None] * delta[..., None, :]
    o = (s * q[..., None]).sum(dim=-2)
    return o, s


class ChunkLayout:
    """Where each token of a varlen batch sits in the padded chunks, built on the host.

    Chunks are ordered by their index within their sequence (all first chunks, then all second
    chunks...), so scan step ``j`` handles the contiguous chunks ``starts[j]:starts[j + 1]``,
    belonging to sequences ``seqs[j]``.

    Args:
        seq_lens: tokens of each sequence (>= 1), in row order.
        chunk: tokens per chunk.
        device: of the index tensors.
    """

    def __init__(self, seq_lens: list[int], chunk: int, device):
        if any(n < 1 for n in seq_lens):
            raise ValueError(f"seq_lens={seq_lens} must all be >= 1")
        t = sum(seq_lens)
        nchunks = [-(-n // chunk) for n in seq_lens]
        most = max(nchunks)
        self.chunk = chunk
        self.num_chunks = sum(nchunks)
        gather = [t] * (self.num_chunks * chunk)  # padded position -> row (t: a zero row)
        scatter = [0] * t  # row -> padded position
        self.starts = [0]
        seqs: list[list[int]] = []
        row0 = [0]
        for n in seq_lens:
            row0.append(row0[-1] + n)
        c = 0
        for j in range(most):
            live = [i for i, nc in enumerate(nchunks) if nc > j]
            for i in live:
                lo = j * chunk
                for p in range(min(chunk, seq_lens[i] - lo)):
                    gather[c * chunk + p] = row0[i] + lo + p
                    scatter[row0[i] + lo + p] = c * chunk + p
                c += 1
            self.starts.append(c)
            seqs.append(live)
        idx = torch.tensor(gather + scatter, dtype=torch.long).to(device)
        self.gather = idx[: len(gather)]  # [M * chunk]
        self.scatter = idx[len(gather) :]  # [T]
        self.seqs = [torch.tensor(s, dtype=torch.long).to(device) for s in seqs]


def delta_rule_chunked(
    q: torch.Tensor,  # [T, H, K] fp32, normalized and scaled
    k: torch.Tensor,  # [T, H, K] fp32, normalized
    v: torch.Tensor,  # [T, H, V] fp32
    g: torch.Tensor,  # [T, H] fp32 log decay (<= 0)
    beta: torch.Tensor,  # [T, H] fp32
    state: torch.Tensor,  # [N, H, K, V] fp32: each sequence's state before its tokens
    layout: ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:  # o [T, H, V], final states [N, H, K, V]
    c = layout.chunk
    m = layout.num_chunks

    def chunked(x):  # [T, H, ...] -> [M, H, C, ...], padded positions zero
        padded = torch.cat([x, x.new_zeros(1, *x.shape[1:])])[layout.gather]
        return padded.view(m, c, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc = chunked(q), chunked(k), chunked(v)  # [M, H, C, K|V]
    gc, bc = chunked(g), chunked(beta)  # [M, H, C]; padding: g = 0 (no decay), beta = 0
    cum = gc.cumsum(dim=-1)  # [M, H, C] log decay from the chunk start through each token
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(cum_i - cum_j) for j <= i, else 0
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = kc * bc[..., None]
    # (I + A) with A strictly lower: A[i, j] = beta_i k_i . k_j decay[i, j]
    a = (kb @ kc.transpose(-1, -2)) * decay
    a = a.masked_fill(lower.logical_not() | torch.eye(c, dtype=torch.bool, device=q.device), 0)
    eye = torch.eye(c, dtype=q.dtype, device=q.device)
    t_mat = eye + a
    u = torch.linalg.solve_triangular(t_mat, vc * bc[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        t_mat, kb * cum.exp()[..., None], upper=False, unitriangular=True
    )  # [M, H, C, K]
    intra = (qc @ kc.transpose(-1, -2)) * decay  # [M, H, C, C]
    q_dec = qc * cum.exp()[..., None]
    k_dec = kc * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [M, H, 1, 1]
    out = torch.empty_like(vc)
    s_all = state.clone()
    for j, seqs in enumerate(layout.seqs):
        lo, hi = layout.starts[j], layout.starts[j + 1]
        s = s_all.index_select(0, seqs)  # [n_j, H, K, V]
        v_new = u[lo:hi] - w[lo:hi] @ s
        out[lo:hi] = q_dec[lo:hi] @ s + intra[lo:hi] @ v_new
        s = s * chunk_decay[lo:hi] + k_dec[lo:hi].transpose(-1, -2) @ v_new
        s_all.index_copy_(0, seqs, s)
    flat = out.transpose(1, 2).reshape(m * c, *out.shape[1:2], out.shape[-1])  # [M*C, H, V]
    return flat[layout.scatter], s_all
