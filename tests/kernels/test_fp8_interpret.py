"""FP8 kernels vs their torch references under Triton's CPU interpreter: per-token-group
activation quantization (tile and loop kernels, groups of 16 / 32 / 128 and one per token, K not
a multiple of the group, row- and column-major scales), the block-scale GEMM and the decode GEMV
(partial blocks in N and K, bias, column-major activation scales), and the quantizing producers
(RMSNorm with and without the residual add, SiLU-and-mul). Runs as a child process
(tests/kernels/interpret_utils.py); real shapes and speed: tests/kernels/test_fp8_kernels.py."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main, run_interpreter_cases

QUANT = [  # (M, K, group, column-major scales)
    (3, 96, 32, False),
    (5, 100, 16, True),  # tile kernel, partial last group
    (2, 384, 128, True),
    (4, 72, 4096, False),  # one per token: the row as one masked tile
    (3, 100, 48, True),  # a group that is no power of 2: the loop kernel
    (2, 17000, 20000, False),  # one per token, a row longer than one tile: the loop kernel
]
GEMM = [  # (M, N, K, block, bias, config override, column-major x scales)
    (1, 64, 64, (32, 32), False, None, False),
    (5, 80, 96, (32, 32), True, None, True),  # partial last N block (80 = 2.5 x 32)
    (3, 48, 72, (16, 32), False, None, False),  # K = 72: a partial last K group
    (40, 64, 128, (32, 64), True, dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32), True),
]
GEMV = [  # (M, N, K, block, bias, config, column-major x scales)
    (1, 64, 64, (32, 32), False, None, True),
    (5, 80, 96, (32, 32), True, (16, 2, 4, 2), False),  # 3 groups in steps of 2
    (16, 48, 72, (16, 32), False, (32, 4, 4, 3), True),  # a partial last group
]
NORM = [
    (3, 256, 128, True),
    (2, 96, 32, False),
    (1, 64, 16, True),  # (T, H, group, residual)
    (3, 96, 4096, True),
]  # one scale per token (compressed-tensors)
ACT = [(3, 256, 128), (2, 100, 32)]  # (T, I, group)


def _fp8_equal(q, q_ref) -> float:
    """Fraction of differing FP8 values, not counting the interpreter's float8 cast bug (numpy
    emulation drops the carry into the next binade: 124.6 becomes 64 instead of 128)."""
    qf, rf = q.float(), q_ref.float()
    carry = (qf != rf) & (qf * 2 == rf) & (rf.abs().log2() == rf.abs().log2().round())
    assert carry.float().mean() < 0.05
    return ((qf != rf) & ~carry).float().mean().item()


def _quant_case(m, k, group, column_major):
    import torch

    from hf_paged.kernels.fp8.fp8_quant import per_token_group_quant, per_token_group_quant_ref

    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m * k)) * 3
    x[0, :8] = 0.0  # a zero run: finite scales
    q, s = per_token_group_quant(x, group, column_major=column_major)
    q_ref, s_ref = per_token_group_quant_ref(x, group)
    assert q.dtype == torch.float8_e4m3fn and s.shape == s_ref.shape
    assert (s.stride(0) == 1) == (column_major and m > 1) or s.shape[1] == 1
    assert torch.allclose(s, s_ref, rtol=1e-6, atol=0)
    # the interpreter's cast also rounds an occasional subnormal (|v| < 2^-6) down: 1 in 34k
    assert _fp8_equal(q, q_ref) < 1e-4
    rf = q_ref.float()
    err = (rf * s.repeat_interleave(min(group, k), 1)[:, :k] - x).abs().max()
    return (err / x.abs().max()).item()


def _problem(m, n, k, block, bias, column_major):
    import torch

    from hf_paged.kernels.fp8.fp8_quant import per_token_group_quant_ref

    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    w_s = torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) + 0.5
    b = torch.randn(n, generator=g) if bias else None
    x_q, x_s = per_token_group_quant_ref(x, block[1])
    if column_major:
        x_s = x_s.t().contiguous().t()
    return x_q, x_s, w, w_s, b


def _gemm_case(m, n, k, block, bias, config, column_major):
    import torch

    from hf_paged.kernels.fp8.fp8_gemm import w8a8_block_matmul, w8a8_matmul_ref

    x_q, x_s, w, w_s, b = _problem(m, n, k, block, bias, column_major)
    out = w8a8_block_matmul(x_q, x_s, w, w_s, block, torch.float32, b, config=config)
    ref = w8a8_matmul_ref(x_q, x_s, w, w_s, block, torch.float32, b)
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _gemv_case(m, n, k, block, bias, config, column_major):
    import torch

    from hf_paged.kernels.fp8.fp8_gemm import w8a8_matmul_ref
    from hf_paged.kernels.fp8.fp8_gemv import fp8_gemv

    x_q, x_s, w, w_s, b = _problem(m, n, k, block, bias, column_major)
    out = fp8_gemv(x_q, x_s, w, w_s, block, torch.float32, b, config=config)
    ref = w8a8_matmul_ref(x_q, x_s, w, w_s, block, torch.float32, b)
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _norm_case(t, h, group, residual):
    import torch

    from hf_paged.kernels.fp8.fp8_fused_quant import rms_norm_quant, rms_norm_quant_ref

    g = torch.Generator().manual_seed(t * h)
    x = torch.randn(t, h, generator=g) * 2
    r = torch.randn(t, h, generator=g) if residual else None
    w = torch.rand(h, generator=g) + 0.5
    q, s, nr = rms_norm_quant(x, r, w, 1e-6, group)
    q_ref, s_ref, nr_ref = rms_norm_quant_ref(x, r, w, 1e-6, group)
    assert s.shape == s_ref.shape and (t == 1 or s.stride(0) == 1)  # column-major
    assert (nr is None) == (r is None) and (nr is None or torch.equal(nr, nr_ref))
    assert torch.allclose(s, s_ref, rtol=1e-5, atol=0)
    return _fp8_equal(q, q_ref)  # the sum of squares may round differently: rare


def _act_case(t, inter, group):
    import torch

    from hf_paged.kernels.fp8.fp8_fused_quant import silu_and_mul_quant, silu_and_mul_quant_ref

    x = torch.randn(t, 2 * inter, generator=torch.Generator().manual_seed(t + inter)) * 3
    q, s = silu_and_mul_quant(x, group)
    q_ref, s_ref = silu_and_mul_quant_ref(x, group)
    assert s.shape == s_ref.shape and (t == 1 or s.stride(0) == 1)
    assert torch.allclose(s, s_ref, rtol=1e-5, atol=0)
    return _fp8_equal(q, q_ref)  # the kernel's exp may differ from torch's in the last ulp


def _cases():
    cases = {}
    for m, k, g, c in QUANT:
        cases[f"quant_m{m}_k{k}_g{g}_cm{int(c)}"] = (_quant_case, (m, k, g, c))
    for kind, fn, rows in (("gemm", _gemm_case, GEMM), ("gemv", _gemv_case, GEMV)):
        for m, n, k, block, bias, cfg, cm in rows:
            name = f"{kind}_m{m}_n{n}_k{k}_b{block[0]}x{block[1]}_cm{int(cm)}"
            cases[name] = (fn, (m, n, k, block, bias, cfg, cm))
    for t, h, group, res in NORM:
        cases[f"norm_t{t}_h{h}_g{group}_r{int(res)}"] = (_norm_case, (t, h, group, res))
    for t, inter, group in ACT:
        cases[f"act_t{t}_i{inter}_g{group}"] = (_act_case, (t, inter, group))
    return cases


@pytest.fixture(scope="module")
def results():
    return run_interpreter_cases(__file__, timeout=900)


def _names(prefix):
    return [n for n in _cases() if n.startswith(prefix)]


@pytest.mark.parametrize("name", _names("quant"))
def test_group_quant_matches_reference(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 1 / 16, f"{name}: dequantized relative error {value}"  # e4m3: 3 mantissa bits


@pytest.mark.parametrize("name", _names("gemm") + _names("gemv"))
def test_block_gemm_and_gemv_match_reference(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 1e-5, f"{name}: relative error {value}"


@pytest.mark.parametrize("name", _names("norm") + _names("act"))
def test_quantizing_producers_match_reference(results, name):
    value = results[name]
    assert not isinstance(value, str), value
    assert value < 0.01, f"{name}: {value:.3%} of the FP8 values differ from the reference's"


def test_block_gemm_rejects_what_it_cannot_take():
    import torch

    from hf_paged.kernels.fp8.fp8_gemm import block_gemm_problem
    from hf_paged.kernels.fp8.fp8_gemv import problem

    x = torch.zeros(2, 64, dtype=torch.float8_e4m3fn)
    w = torch.zeros(32, 64, dtype=torch.float8_e4m3fn)
    assert "powers of 2 >= 16" in block_gemm_problem(x, torch.ones(2, 8), w, torch.ones(4, 8),
                                                     (8, 8))  # fmt: skip
    assert "do not fit" in block_gemm_problem(x, torch.ones(2, 1), w, torch.ones(1, 1), (32, 32))
    assert block_gemm_problem(x, torch.ones(2, 2), w, torch.ones(1, 2), (32, 32)) is None
    big = torch.zeros(17, 64, dtype=torch.float8_e4m3fn)
    assert "1 <= M <= 16" in problem(big, torch.ones(17, 2), w, torch.ones(1, 2), (32, 32))
    assert problem(x, torch.ones(2, 2), w, torch.ones(1, 2), (32, 32)) is None


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8])
def test_cublaslt_operands_padded_to_four_rows(monkeypatch, m):
    """``block_scaled_mm`` hands cuBLASLt a multiple of 4 rows (it refuses M = 1 on the H200:
    CUBLAS_STATUS_NOT_SUPPORTED) with column-major scales, and returns the M rows of the
    reference. ``F.scaled_mm`` is replaced by the torch reference, which also checks the
    operands as cuBLASLt receives them."""
    import torch

    from hf_paged.kernels.fp8 import fp8_scaled_mm
    from hf_paged.kernels.fp8.fp8_gemm import w8a8_matmul_ref
    from hf_paged.kernels.fp8.fp8_quant import empty_scales, per_token_group_quant_ref

    if not fp8_scaled_mm.available():
        pytest.skip("no block-wise F.scaled_mm in this torch")
    g = torch.Generator().manual_seed(m)
    x = torch.randn(m, 512, generator=g)
    x_q, s = per_token_group_quant_ref(x, 128)
    x_s = empty_scales(m, 4, True, "cpu").copy_(s)  # [M, 4] strides (1, M)
    w = (torch.randn(256, 512, generator=g) * 0.05).to(torch.float8_e4m3fn)
    w_s = torch.rand(2, 4, generator=g) * 0.01 + 0.001
    bias = torch.randn(256, generator=g).to(torch.bfloat16)
    seen = []

    def fake_scaled_mm(a, b_t, a_s, a_recipe, b_s_t, b_recipe, output_dtype):
        mp = a.shape[0]
        seen.append(mp)
        assert mp % fp8_scaled_mm.ROW_MULTIPLE == 0 and a_s.shape == (mp, 4)
        assert a_s.stride() == (1, mp) and a.is_contiguous()
        return w8a8_matmul_ref(a, a_s, b_t.t(), b_s_t.t(), (128, 128), output_dtype)

    monkeypatch.setattr(fp8_scaled_mm, "_SCALED_MM", fake_scaled_mm)
    out = fp8_scaled_mm.block_scaled_mm(x_q, x_s, w, w_s, torch.bfloat16, bias)
    ref = w8a8_matmul_ref(x_q, x_s, w, w_s, (128, 128), torch.bfloat16, bias)
    assert seen == [-(-m // 4) * 4] and out.shape == (m, 256)
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-3)  # bias added in bf16
    q_p, s_p = fp8_scaled_mm.pad_rows(x_q, x_s)
    assert q_p[m:].float().eq(0).all() and s_p[m:].eq(1).all()  # padded rows: exact zeros
    assert torch.equal(q_p[:m].float(), x_q.float()) and torch.equal(s_p[:m], x_s)
    if m == 1:  # a [1, G] row-major row is as good as column-major
        assert torch.equal(fp8_scaled_mm.pad_rows(x_q, s)[1], s_p)


if __name__ == "__main__":
    interpret_main(_cases())
