"""Each kernel switch of hf_paged/envs.py turns off exactly the kernels its docstring names."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
pytest.importorskip("triton")

from hf_paged import envs  # noqa: E402
from hf_paged.kernels import (  # noqa: E402
    argmax,
    fused_act,
    fused_norm,
    fused_rope,
    skinny_gemm,
    token_scores,
)


def _dispatch() -> dict[str, bool]:
    """Which kernels take inputs each of them supports, under the current switches."""
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(2, 4096, device=dev, dtype=dt)
    w = torch.randn(4096, device=dev, dtype=dt)
    q = torch.randn(3, 4, 64, device=dev, dtype=dt)
    k = torch.randn(3, 2, 64, device=dev, dtype=dt)
    cos = torch.randn(3, 64, device=dev, dtype=dt)
    return {
        "norm": fused_norm.supports(x, w),
        "act": fused_act.supports(x),
        "rope": fused_rope.supports(q, k, cos, cos.clone()),
        "argmax": argmax.supports(torch.randn(2, 1000, device=dev)),
        "skinny_gemm": skinny_gemm.supports(x, torch.randn(64, 4096, device=dev, dtype=dt)),
        "token_scores": token_scores.supports(
            x, torch.zeros(2, dtype=torch.int64, device=dev), torch.empty(2, 2, device=dev)
        ),
    }


ALL_ON = {
    "norm": True, "act": True, "rope": True, "argmax": True, "skinny_gemm": True,
    "token_scores": True,
}  # fmt: skip


@pytest.mark.parametrize(
    "switch, off",
    [
        ("HF_PAGED_FUSED", {"norm", "act", "rope"}),
        ("HF_PAGED_ARGMAX", {"argmax"}),
        ("HF_PAGED_SKINNY_GEMM", {"skinny_gemm"}),
        ("HF_PAGED_TOKEN_SCORES", {"token_scores"}),
    ],
)
def test_switch_covers_exactly_its_kernels(monkeypatch, switch, off):
    assert _dispatch() == ALL_ON
    monkeypatch.setattr(envs, switch, False)
    assert _dispatch() == {name: name not in off for name in ALL_ON}
