"""Per-row log-softmax + gather + rank over ``[R, V]`` logits (Triton + torch reference).

What prompt logprobs need of each scored row: the target token's logprob, its rank (1 + how many
ids come before it in (logprob desc, id asc) order; 1 is lm-eval's ``is_greedy``) and, rarely,
the top k. The reference takes ``log_softmax`` in fp32 of the whole ``[R, V]`` slice, as the
engine always did: at V = 152k that is ~0.6 GB of fp32 temporaries per 1,000 rows and ~10 passes
over them. The kernel reads each row once in the model's dtype (one program per row, ``BLOCK``
columns at a time, upcast in registers) and keeps a running max, a running sum of exponentials
and a running count of the logits before the target's; it writes logprob and rank straight into
the caller's packed result and (for top k) the row's logsumexp. Top k (k > 0) stays on
``torch.topk`` over the model-dtype logits, minus the logsumexp.

Semantics: the reference compares logprobs (``x - lse`` in fp32), the kernel compares logits
(upcast to fp32). They order ids the same except where fp32 rounding of ``x - lse`` merges two
distinct logits; with bf16 logits that needs both to be within ~1e-6 of each other in value, a
tie in every other sense. Logprobs agree to fp32 rounding (~1e-6 relative). Rows with a NaN give
a NaN logprob in both; a row of only ``-inf`` gives NaN in both.
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

BLOCK = 4096  # columns per loop iteration (bf16: 8 KB per row per iteration)


def _problem(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> str | None:
    if logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        return f"logits must be a non-empty [R, V] tensor, got {tuple(logits.shape)}"
    if logits.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"logits must be fp16, bf16 or fp32, got {logits.dtype}"
    if logits.shape[1] >= 2**24:
        return f"V={logits.shape[1]} does not fit exact fp32 ranks (< 2**24)"
    r = logits.shape[0]
    if targets.shape != (r,) or targets.dtype not in (torch.int32, torch.int64):
        return f"targets must be int32/int64 [{r}], got {targets.dtype} {tuple(targets.shape)}"
    if targets.stride(0) != 1:
        return f"targets must be contiguous, got stride {targets.stride(0)}"
    if out.dim() != 2 or out.shape[0] != r or out.shape[1] < 2 or out.dtype != torch.float32:
        return f"out must be fp32 [{r}, >= 2], got {out.dtype} {tuple(out.shape)}"
    if out.stride(1) != 1:
        return f"out's rows must be contiguous, got column stride {out.stride(1)}"
    if len({logits.device, targets.device, out.device}) != 1:
        return "logits, targets and out must be on one device"
    return None


def enabled(device: torch.device) -> bool:
    """Whether rows on ``device`` go to the kernel (``HF_PAGED_TOKEN_SCORES``, CUDA, Triton)."""
    return envs.HF_PAGED_TOKEN_SCORES and triton is not None and device.type == "cuda"


def supports(logits: torch.Tensor, targets: torch.Tensor, out: torch.Tensor) -> bool:
    return enabled(logits.device) and _problem(logits, targets, out) is None


@torch.inference_mode()
def token_scores_reference(logits: torch.Tensor, targets: torch.Tensor, k: int):
    """[r, V] logits, [r] targets -> logprob [r], rank [r], top-k logprobs / ids [r, k] (fp32
    log_softmax of the whole slice; ranks compare logprobs, ties broken by lower id first)."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [r, V]
    tgt = lp.gather(1, targets[:, None])  # [r, 1]
    ids = torch.arange(lp.shape[1], device=lp.device)
    before = (lp > tgt) | ((lp == tgt) & (ids[None, :] < targets[:, None]))
    rank = 1 + before.sum(dim=1)  # [r]
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], targets[:, None][:, :0])
    return tgt[:, 0], rank, top_v, top_i


def token_scores(logits: torch.Tensor, targets: torch.Tensor, k: int, out: torch.Tensor) -> None:
    """Fill ``out`` [r, 2 + 2k] fp32 with (logprob, rank, k top logprobs, k top ids) per row of
    ``logits`` [r, V] scoring ``targets`` [r]: the kernel where it takes them, else the torch
    reference.

    Raises:
        ValueError: ``out`` is not [r, 2 + 2k].
    """
    if out.dim() != 2 or out.shape[1] != 2 + 2 * k:
        raise ValueError(
            f"out of shape {tuple(out.shape)} is not allowed: must be [r, {2 + 2 * k}]"
        )
    if not supports(logits, targets, out):
        lp, rank, top_v, top_i = token_scores_reference(logits, targets, k)
        out[:, 0] = lp
        out[:, 1] = rank.float()
        out[:, 2 : 2 + k] = top_v
        out[:, 2 + k :] = top_i.float()
        return
    _kernel_scores(logits, targets, k, out)


def token_scores_kernel(
    logits: torch.Tensor, targets: torch.Tensor, k: int, out: torch.Tensor
) -> None:
    """``token_scores`` through the kernel whatever the device (the interpreter runs it on CPU
    tensors).

    Raises:
        ValueError: inputs the kernel does not take (see ``_problem``), or ``out`` not
            [r, 2 + 2k].
    """
    problem = _problem(logits, targets, out)
    if problem is None and out.shape[1] != 2 + 2 * k:
        problem = f"out must be [r, {2 + 2 * k}] for k={k}, got {tuple(out.shape)}"
    if problem is not None:
        raise ValueError(f"unsupported input for token_scores: {problem}")
    _kernel_scores(logits, targets, k, out)


def _kernel_scores(logits, targets, k: int, out) -> None:  # inputs checked
    lse = _launch(logits, targets, out, want_lse=k > 0)
    if k:
        top_x, top_i = logits.topk(k, dim=-1)  # [r, k] in the model dtype
        out[:, 2 : 2 + k] = top_x.float() - lse[:, None]
        out[:, 2 + k :] = top_i.float()


if triton is not None:
    from hf_paged.kernels.pdl import pdl_enter

    @triton.jit
    def _token_scores_kernel(
        x_ptr, tgt_ptr, out_ptr, lse_ptr, stride_x, stride_out, V,
        BLOCK: tl.constexpr, STORE_LSE: tl.constexpr, USE_PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_enter(USE_PDL)  # no-op unless PDL is on (kernels/pdl.py)
        row = tl.program_id(0)
        x_row = x_ptr + row.to(tl.int64) * stride_x
        t = tl.load(tgt_ptr + row).to(tl.int64)
        xt = tl.load(x_row + t).to(tl.float32)  # the target's logit
        cols = tl.arange(0, BLOCK)
        m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)  # running max (scalar)
        s_lanes = tl.zeros([BLOCK], tl.float32)  # per column lane: sum of exp(x - m)
        ahead = tl.zeros([BLOCK], tl.int32)  # per column lane: ids ahead of the target
        # the next block's load is issued before this block's math: two loads in flight per
        # program keep HBM busy without relying on the compiler to pipeline the loop
        x_next = tl.load(x_row + cols, mask=cols < V, other=float("-inf"))
        for start in range(0, V, BLOCK):
            c = start + cols
            x = x_next.to(tl.float32)
            n = c + BLOCK
            x_next = tl.load(x_row + n, mask=n < V, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            # a block (and everything before it) of -inf keeps m = -inf: no exp(-inf - -inf)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            s_lanes = s_lanes * tl.exp(m - m_safe) + tl.exp(x - m_safe)
            m = m_new
            # masked columns are -inf at c >= V > t: never ahead
            ahead += ((x > xt) | ((x == xt) & (c < t))).to(tl.int32)
        lse = m + tl.log(tl.sum(s_lanes, axis=0))
        rank = tl.sum(ahead, axis=0) + 1
        tl.store(out_ptr + row.to(tl.int64) * stride_out, xt - lse)
        tl.store(out_ptr + row.to(tl.int64) * stride_out + 1, rank.to(tl.float32))
        if STORE_LSE:
            tl.store(lse_ptr + row, lse)


def _launch(logits, targets, out, want_lse: bool) -> torch.Tensor | None:  # inputs checked
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    r, v = logits.shape
    lse = torch.empty(r if want_lse else 1, dtype=torch.float32, device=logits.device)
    _token_scores_kernel[(r,)](
        logits, targets, out, lse, logits.stride(0), out.stride(0), v,
        BLOCK=max(16, min(BLOCK, triton.next_power_of_2(v))), STORE_LSE=want_lse, num_warps=8,
        **pdl_kwargs(logits),
    )  # fmt: skip
    return lse if want_lse else None
