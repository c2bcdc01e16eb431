"""Prompt-logprob kernel (``kernels/token_scores.py``) vs its torch reference (fp32 log_softmax
of the whole row) under Triton's CPU interpreter, in a child process like
tests/kernels/test_argmax.py: fp32 / bf16 / fp16 rows, V across block boundaries and
below one block, strided rows, ties with the target (lower and higher ids), the target as the
maximum, ``-inf`` columns, top k. GPU cases at the Qwen3 vocabulary are in
below (marker ``gpu``).

Prompt-logprob kernel (``kernels/token_scores.py``) on CUDA at the Qwen3 vocabulary: bf16 and
fp32 logits, a padded-vocabulary view (row stride > V), top k, against the fp32 log_softmax
reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from hf_paged.kernels import token_scores as ts  # noqa: E402
from hf_paged.testing.markers import marked
from tests.kernels.interpret_utils import interpret_main

# ---- under Triton's CPU interpreter (the cases run in one child process) --------------------------


TOL = 2e-5  # fp32: logprobs of magnitude ~10, summed in another order


def _make(kind, r, v, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(r * 131 + v)
    x = (3 * torch.randn(r, v + 3, generator=gen))[:, :v]  # row stride v + 3
    t = torch.randint(0, v, (r,), generator=gen)
    if kind == "ties":  # the target's value at ids below and above it, and in other blocks
        t[:] = v // 2
        for c in (1, v // 2 - 1, v // 2 + 1, v - 1):
            x[:, c] = x[:, v // 2]
    elif kind == "argmax":  # row 0: the unique max; row 1: tied with a lower id (rank 2)
        x[:, 7] = 50.0
        t[0], t[1] = 7, 9
        x[1, 9] = 50.0
    elif kind == "ninf":  # every other column -inf, one whole block too
        x[:, ::2] = float("-inf")
        x[:, : min(v, 4096)] = float("-inf")
        t[:] = v - 1
    x = x.to(dtype)
    return x, t


def _case(kind, r, v, dtype_name, k):
    import torch

    from hf_paged.kernels.token_scores import token_scores_kernel, token_scores_reference

    x, t = _make(kind, r, v, dtype_name)
    got = torch.full((r, 2 + 2 * k), float("nan"))
    token_scores_kernel(x, t, k, got)
    lp, rank, top_v, top_i = token_scores_reference(x, t, k)
    assert torch.allclose(got[:, 0], lp, atol=TOL, rtol=1e-6), (got[:, 0], lp)
    assert got[:, 1].tolist() == rank.float().tolist(), (got[:, 1], rank)
    assert torch.allclose(got[:, 2 : 2 + k], top_v, atol=TOL, rtol=1e-6)
    assert got[:, 2 + k :].tolist() == top_i.float().tolist()
    if kind == "argmax":
        assert got[:2, 1].tolist() == [1.0, 2.0]
    return 0.0


CASES = [
    ("random", 3, 9000, "float32", 0),  # 3 blocks, the last partial
    ("random", 4, 8192, "bfloat16", 0),  # whole blocks
    ("random", 2, 5000, "float16", 3),
    ("random", 3, 37, "float32", 2),  # V below one block
    ("random", 1, 1, "float32", 0),
    ("ties", 2, 9000, "bfloat16", 0),
    ("ties", 2, 300, "float32", 0),
    ("argmax", 2, 9000, "float32", 1),
    ("ninf", 2, 9000, "float32", 0),
]


def _cases():
    return {f"{kind}_r{r}_v{v}_{d}_k{k}": (_case, (kind, r, v, d, k)) for kind, r, v, d, k in CASES}




@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_matches_reference(interpreted, name):
    value = interpreted[name]
    assert value == 0.0


def test_rejects_what_it_cannot_take():
    import torch

    from hf_paged.kernels.token_scores import token_scores, token_scores_kernel

    t = torch.zeros(2, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"non-empty \[R, V\]"):
        token_scores_kernel(torch.zeros(3), t, 0, torch.empty(2, 2))
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        token_scores_kernel(torch.zeros(2, 5, dtype=torch.int32), t, 0, torch.empty(2, 2))
    with pytest.raises(ValueError, match="targets must be int32/int64"):
        token_scores_kernel(torch.zeros(2, 5), t.float(), 0, torch.empty(2, 2))
    with pytest.raises(ValueError, match=r"must be \[r, 4\]"):
        token_scores_kernel(torch.zeros(2, 5), t, 1, torch.empty(2, 2))
    with pytest.raises(ValueError, match=r"must be \[r, 2\]"):
        token_scores(torch.zeros(2, 5), t, 0, torch.empty(2, 3))


def test_reference_on_cpu():
    """``token_scores`` on CPU is the reference, written into the packed layout."""
    import torch

    from hf_paged.kernels.token_scores import token_scores

    x = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    t = torch.tensor([4, 0, 49])
    out = torch.empty(3, 6)
    token_scores(x, t, 2, out)
    lp = torch.log_softmax(x, dim=-1)
    assert torch.equal(out[:, 0], lp.gather(1, t[:, None])[:, 0])
    assert out[:, 1].tolist() == [1 + int((lp[i] > lp[i, t[i]]).sum()) for i in range(3)]
    top_v, top_i = lp.topk(2, dim=-1)
    assert torch.equal(out[:, 2:4], top_v) and torch.equal(out[:, 4:], top_i.float())


# ---- on CUDA --------------------------------------------------------------------------------------


_MARKS_TOKEN_SCORES_KERNELS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton"),
]


V = 151936  # Qwen3


def _logit_rank(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """1 + ids ahead of the target comparing the fp32-upcast logits (the kernel's order)."""
    xf = x.float()
    xt = xf.gather(1, t[:, None])
    ids = torch.arange(x.shape[1], device=x.device)
    return 1 + ((xf > xt) | ((xf == xt) & (ids[None] < t[:, None]))).sum(1)


@marked(_MARKS_TOKEN_SCORES_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [0, 4])
@pytest.mark.parametrize("pad", [0, 64])
def test_matches_reference_at_qwen3_vocab(dtype, k, pad):
    g = torch.Generator(device="cuda").manual_seed(k + pad)
    r = 700
    full = 2 * torch.randn(r, V + pad, device="cuda", generator=g)
    x = full.to(dtype)[:, :V]  # ParallelLMHead's view of a padded vocabulary: stride V + pad
    t = torch.randint(0, V, (r,), device="cuda", generator=g)
    t[:5] = x[:5].float().argmax(-1)  # some targets are the argmax (rank 1)
    out = torch.empty(r, 2 + 2 * k, device="cuda")
    assert ts.supports(x, t, out)
    ts.token_scores(x, t, k, out)
    lp, rank, top_v, top_i = ts.token_scores_reference(x, t, k)
    assert torch.allclose(out[:, 0], lp, atol=2e-5, rtol=1e-6), (out[:, 0] - lp).abs().max()
    got_rank = out[:, 1].long()
    assert torch.equal(got_rank, _logit_rank(x, t))
    assert torch.equal(got_rank == 1, rank == 1)  # is_greedy
    assert (got_rank - rank).abs().max() <= 1  # logprob ties only where fp32 merges logits
    assert (got_rank[:5] == 1).all()
    assert torch.allclose(out[:, 2 : 2 + k], top_v, atol=2e-5, rtol=1e-6)
    if dtype == torch.float32:  # bf16 rows hold exact ties, which topk may order either way
        assert torch.equal(out[:, 2 + k :].long(), top_i)


@marked(_MARKS_TOKEN_SCORES_KERNELS)
def test_same_bits_with_and_without_pdl(monkeypatch):
    """Launched right after the LM-head GEMM that writes its logits, with PDL (where the device
    has it) and without: the same bits."""
    from hf_paged import envs

    g = torch.Generator(device="cuda").manual_seed(1)
    w = 0.02 * torch.randn(V, 1024, device="cuda", generator=g).bfloat16()
    h = torch.randn(512, 1024, device="cuda", generator=g).bfloat16()
    t = torch.randint(0, V, (512,), device="cuda", generator=g)
    outs = []
    for pdl in (False, True):
        monkeypatch.setattr(envs, "HF_PAGED_PDL", pdl)
        out = torch.empty(512, 4, device="cuda")
        ts.token_scores(torch.nn.functional.linear(h, w), t, 1, out)
        outs.append(out)
    assert torch.equal(outs[0], outs[1])


if __name__ == "__main__":
    interpret_main(_cases())
