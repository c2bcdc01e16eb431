"""Skinny GEMM (decode-batch linear layers) vs ``F.linear`` under Triton's CPU interpreter, fp16:
row counts 1..16, N and K that are not multiples of the tiles, bias, a strided weight view.
Runs as a child process like tests/unit/test_kernels_interpret.py; GPU cases (bf16, the real
shapes) are in tests/gpu/test_skinny_gemm.py."""

from __future__ import annotations

import pytest

from tests.unit.interpret_utils import interpret_main, run_interpreter_cases

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


PROLOGUE_CASES = [  # (M, N, K, config): K not a multiple of BLOCK_K, rows 1..16
    (1, 64, 128, (16, 64, 4, 2)),
    (3, 40, 200, (16, 64, 4, 2)),
    (16, 48, 96, (32, 32, 4, 2)),
]


def _silu_case(m, n, k, config):
    """silu_mul_gemm == fused_act's rounding then skinny_gemm, bit for bit."""
    import torch

    from hf_paged.kernels.fused_act import silu_and_mul
    from hf_paged.kernels.skinny_gemm import silu_mul_gemm, skinny_gemm

    gen = torch.Generator().manual_seed(m * 7 + k)
    gate_up = (torch.randn(m, 2 * k + 16, generator=gen) * 2).half()[:, : 2 * k]  # row stride
    w = (torch.randn(n, k, generator=gen) * k**-0.5).half()
    out = silu_mul_gemm(gate_up, w, config=config)
    ref = skinny_gemm(silu_and_mul(gate_up), w, config=config)
    assert out.shape == (m, n) and out.dtype == torch.float16
    return (out.float() - ref.float()).abs().max().item()


def _norm_case(m, n, k, config, residual):
    """rms_norm_gemm vs HF's RMSNorm (torch reference) then an fp32 linear; returns the
    relative error; the new residual must be x + residual exactly."""
    import torch
    import torch.nn.functional as F

    from hf_paged.kernels.fused_norm import fused_add_rms_norm_ref, rms_norm_ref
    from hf_paged.kernels.skinny_gemm import rms_norm_gemm

    gen = torch.Generator().manual_seed(m * 13 + k)
    x = (torch.randn(m, k, generator=gen) * 3).half()
    res = (torch.randn(m, k, generator=gen) * 3).half() if residual else None
    nw = (1 + 0.1 * torch.randn(k, generator=gen)).half()
    w = (torch.randn(n, k, generator=gen) * k**-0.5).half()
    out, new_res = rms_norm_gemm(x, res, nw, 1e-5, w, config=config)
    if residual:
        h, ref_res = fused_add_rms_norm_ref(x, res, nw, 1e-5)
        assert torch.equal(new_res, ref_res), "new residual != x + residual"
    else:
        h = rms_norm_ref(x, nw, 1e-5)
        assert new_res is None
    ref = F.linear(h.float(), w.float())
    assert out.shape == (m, n) and out.dtype == torch.float16
    return ((out.float() - ref).abs().max() / ref.abs().max()).item()


def _cases():
    cases = {f"m{m}_n{n}_k{k}_b{int(b)}": (_case, (m, n, k, b, c)) for m, n, k, b, c in CASES}
    for m, n, k, c in PROLOGUE_CASES:
        cases[f"silu_m{m}_n{n}_k{k}"] = (_silu_case, (m, n, k, c))
        for r in (False, True):
            cases[f"norm_m{m}_n{n}_k{k}_r{int(r)}"] = (_norm_case, (m, n, k, c, r))
    return cases


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases(__file__, timeout=600)


@pytest.mark.parametrize("name", [n for n in _cases() if n[0] == "m"])
def test_skinny_gemm_matches_linear(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 2e-3, f"{name}: relative error {value}"


@pytest.mark.parametrize("name", [n for n in _cases() if n.startswith("silu")])
def test_silu_prologue_is_the_unfused_bits(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value == 0.0, f"{name}: differs from silu_and_mul + skinny_gemm by {value}"


@pytest.mark.parametrize("name", [n for n in _cases() if n.startswith("norm")])
def test_norm_prologue_matches_norm_then_linear(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 4e-3, f"{name}: relative error {value}"


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


def test_prologue_inputs_are_checked():
    import torch

    from hf_paged.kernels.skinny_gemm import rms_norm_gemm, silu_mul_gemm

    w = torch.zeros(32, 64, dtype=torch.float16)
    x = torch.zeros(2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"gate_up must be \[M, 2K\]"):
        silu_mul_gemm(x, w)
    with pytest.raises(ValueError, match="norm weight"):
        rms_norm_gemm(x, None, torch.zeros(32, dtype=torch.float16), 1e-6, w)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_gemm(x, torch.zeros(3, 64, dtype=torch.float16), torch.zeros(64).half(), 1e-6, w)


def test_prologue_switch_values():
    from hf_paged.kernels.skinny_gemm import parse_prologues

    assert parse_prologues("1") == parse_prologues("all") == {"norm", "silu"}
    assert parse_prologues("0") == parse_prologues("none") == set()
    assert parse_prologues(" norm ") == {"norm"}
    assert parse_prologues("silu,norm") == {"norm", "silu"}
    with pytest.raises(ValueError, match="HF_PAGED_SKINNY_PROLOGUES='gelu'.*norm, silu"):
        parse_prologues("gelu")


if __name__ == "__main__":
    interpret_main(_cases())
