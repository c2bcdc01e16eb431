"""Prompt-logprob kernel (``kernels/token_scores.py``) on CUDA at the Qwen3 vocabulary: bf16 and
fp32 logits, a padded-vocabulary view (row stride > V), top k, against the fp32 log_softmax
reference."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from hf_paged.kernels import token_scores as ts  # noqa: E402

V = 151936  # Qwen3


def _logit_rank(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """1 + ids ahead of the target comparing the fp32-upcast logits (the kernel's order)."""
    xf = x.float()
    xt = xf.gather(1, t[:, None])
    ids = torch.arange(x.shape[1], device=x.device)
    return 1 + ((xf > xt) | ((xf == xt) & (ids[None] < t[:, None]))).sum(1)


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
