"""Skinny GEMM (decode-batch linear layers) vs ``F.linear`` under Triton's CPU interpreter, fp16:
row counts 1..16, N and K that are not multiples of the tiles, bias, a strided weight view.
Runs as a child process like tests/kernels/test_kernels_interpret.py; GPU cases (bf16, the real
shapes) are in tests/kernels/test_skinny_gemm.py."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main, run_interpreter_cases

CASES = [  # (M, N, K, bias, config)
    (1, 64, 128, False, (16, 64, 4, 2)),
    (3, 40, 72, True, (16, 32, 4, 2)),  # N, K not multiples of the tiles
    (16, 48, 256, False, (32, 128, 4, 2)),
    (7, 33, 64, True, (16, 64, 4, 2)),
]


def _case(m, n, k, bias, config):
    import torch
    import torch.nn.functional as F

    from hf_paged.kernels.skinny_gemm import skinny_gemm

    gen = torch.Generator().manual_seed(m * 1000 + n)
    x = torch.randn(m, k, generator=gen).half()
    big = torch.randn(n, k + 8, generator=gen).half()  # row stride k + 8: a strided view
    w = big[:, :k]
    b = torch.randn(n, generator=gen).half() if bias else None
    out = skinny_gemm(x, w, b, config=config)
    ref = F.linear(x.float(), w.float(), b.float() if bias else None)
    assert out.shape == (m, n) and out.dtype == torch.float16
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _cases():
    return {f"m{m}_n{n}_k{k}_b{int(b)}": (_case, (m, n, k, b, c)) for m, n, k, b, c in CASES}


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases(__file__, timeout=600)


@pytest.mark.parametrize("name", list(_cases()))
def test_skinny_gemm_matches_linear(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 2e-3, f"{name}: relative error {value}"


def test_rejects_what_it_cannot_take():
    import torch

    from hf_paged.kernels.skinny_gemm import skinny_gemm

    x = torch.zeros(17, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 <= M <= 16"):
        skinny_gemm(x, torch.zeros(32, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="fp16 or bf16"):
        skinny_gemm(torch.zeros(2, 64), torch.zeros(32, 64))
    with pytest.raises(ValueError, match="must be % 8"):
        skinny_gemm(
            torch.zeros(2, 60, dtype=torch.float16), torch.zeros(32, 60, dtype=torch.float16)
        )


if __name__ == "__main__":
    interpret_main(_cases())
