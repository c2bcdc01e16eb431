"""The FP8 linear layer's GEMM choice and its W8A8 reference, on CPU: the path table
(``kernels/fp8/fp8_paths.py``) and ``gemm_path``'s rules (the device facts faked), the layout the
cuBLASLt block-wise call passes (checked by torch's own meta kernel of ``F.scaled_mm``), the W8A8
reference against the kernel-level references, ``fp8_linear`` on quantized activations
(``Fp8Activation``), and the row-wise ``torch._scaled_mm`` path (compressed-tensors), which
torch runs on CPU too."""

from __future__ import annotations

import json

import pytest
import torch

from hf_paged import envs
from hf_paged.kernels.fp8 import fp8_paths, fp8_scaled_mm
from hf_paged.kernels.fp8.fp8_gemm import w8a8_matmul_ref, w8a8_rowwise_matmul
from hf_paged.kernels.fp8.fp8_quant import empty_scales, per_token_group_quant_ref
from hf_paged.layers.quantization import fp8_linear as fl
from hf_paged.layers.quantization.fp8_activation import Fp8Activation
from hf_paged.layers.quantization.w8a8_reference import w8a8_linear_ref

SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]


@pytest.fixture
def fp8_gemm_env(monkeypatch):
    """Set ``HF_PAGED_FP8_GEMM`` for one test (the switch is cached once read)."""

    def set_(value: str) -> None:
        monkeypatch.setenv("HF_PAGED_FP8_GEMM", value)
        envs.reset("HF_PAGED_FP8_GEMM")

    yield set_
    monkeypatch.delenv("HF_PAGED_FP8_GEMM", raising=False)
    envs.reset("HF_PAGED_FP8_GEMM")


def _weights(n, k, block, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.05).to(torch.float8_e4m3fn)
    if block is None:
        return w, torch.rand(n, 1, generator=g) * 0.01 + 0.001
    return w, torch.rand(-(-n // block[0]), -(-k // block[1]), generator=g) * 0.01 + 0.001


# ---- the path table ---------------------------------------------------------------------------


def test_path_table_lookup_rounds_rows_up_to_the_measured_class(tmp_path):
    table = {"m_classes": [1, 16, 64, 2048], "shapes": {
        "6144x4096": {"1": {"path": "gemv", "config": [16, 2, 4, 6]}, "16": {"path": "cublaslt"},
                      "2048": {"path": "triton", "config": {"BLOCK_M": 128}}}}}  # fmt: skip
    path = tmp_path / "paths.json"
    path.write_text(json.dumps(table))
    assert fp8_paths.lookup(6144, 4096, 1, path) == fp8_paths.PathChoice("gemv", (16, 2, 4, 6))
    assert fp8_paths.lookup(6144, 4096, 9, path).path == "cublaslt"
    assert fp8_paths.lookup(6144, 4096, 30, path) is None  # class 64 not measured
    assert fp8_paths.lookup(6144, 4096, 100000, path).config == {"BLOCK_M": 128}  # the last
    assert fp8_paths.lookup(4096, 4096, 1, path) is None


def test_path_table_refuses_unknown_paths_by_name():
    with pytest.raises(ValueError, match=r"path='cutlass' is not allowed.*cublaslt"):
        fp8_paths.parse_table({"shapes": {"64x64": {"1": {"path": "cutlass"}}}})
    with pytest.raises(ValueError, match="must be 'NxK'"):
        fp8_paths.parse_table({"shapes": {"64": {}}})


def test_checked_in_path_table_parses():
    classes, table = fp8_paths.parse_table(json.loads(fp8_paths.TABLE_PATH.read_text()))
    assert classes == tuple(sorted(classes)) and all(c > 0 for c in classes)
    assert all(c.path in fp8_paths.BLOCK_PATHS for c in table.values())


# ---- gemm_path --------------------------------------------------------------------------------


def test_cpu_runs_the_dequantized_weights_unless_told(fp8_gemm_env):
    cpu = torch.device("cpu")
    assert fl.gemm_path(4, 256, 256, cpu, torch.bfloat16, (128, 128)) == "dequant"
    assert fl.gemm_path(4, 256, 256, cpu, torch.bfloat16, None) == "dequant"
    fp8_gemm_env("w8a8_ref")
    assert fl.gemm_path(4, 256, 256, cpu, torch.bfloat16, (128, 128)) == "w8a8_ref"
    assert not fl.quantizes_activations(cpu)


def test_gpu_rules_with_the_device_faked(monkeypatch, fp8_gemm_env, tmp_path):
    """On a Hopper with block-wise ``F.scaled_mm``: cuBLASLt wherever it takes the shape, the
    Triton kernel elsewhere, the table's choice where it has one, a forced path where it takes
    the shape."""
    fl._path.cache_clear()
    monkeypatch.setattr(fl, "_gpu_fp8", lambda device: True)
    monkeypatch.setattr(fp8_scaled_mm, "available", lambda: True)
    monkeypatch.setattr(fp8_scaled_mm, "device_ok", lambda device: True)
    table = tmp_path / "paths.json"
    table.write_text(json.dumps({"shapes": {"6144x4096": {"1": {"path": "gemv"}}}}))
    monkeypatch.setattr(fp8_paths, "TABLE_PATH", table)
    monkeypatch.setattr(fp8_paths.lookup, "__defaults__", (table,))
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    for n, k in SHAPES_8B:
        for m in (1, 16, 64, 256, 2048, 8192):
            want = "gemv" if (n, k) == (6144, 4096) and m == 1 else "cublaslt"
            assert fl.gemm_path(m, n, k, dev, bf16, (128, 128)) == want, (n, k, m)
    assert fl.gemm_path(8, 6144, 640, dev, bf16, (128, 128)) == "triton"  # K/128 = 5
    assert fl.gemm_path(8, 6144, 4096, dev, bf16, (64, 64)) == "triton"  # not 128 x 128
    assert fl.gemm_path(8, 6144, 4096, dev, torch.float16, (128, 128)) == "triton"
    assert fl.gemm_path(8, 6144, 4096, dev, bf16, None) == "rowwise"
    assert fl.gemm_path(8, 6144, 4096, dev, bf16, (128, 96)) == "dequant"  # no power of 2
    fp8_gemm_env("gemv")
    assert fl.gemm_path(16, 4096, 4096, dev, bf16, (128, 128)) == "gemv"
    assert fl.gemm_path(17, 4096, 4096, dev, bf16, (128, 128)) == "cublaslt"  # GEMV: M <= 16
    fp8_gemm_env("triton")
    assert fl.gemm_path(4096, 4096, 4096, dev, bf16, (128, 128)) == "triton"
    assert fl.quantizes_activations(dev)
    fp8_gemm_env("dequant")
    assert not fl.quantizes_activations(dev)
    fl._path.cache_clear()  # the faked device facts must not outlive the test


# ---- the cuBLASLt call's layout ---------------------------------------------------------------


@pytest.mark.skipif(
    not fp8_scaled_mm.available(), reason="this torch has no block-wise F.scaled_mm"
)
@pytest.mark.parametrize("m", [1, 3, 16, 100])
def test_block_scaled_mm_layout_passes_torch_checks(m):
    """torch's meta kernel of ``F.scaled_mm`` holds the layout rules of the CUDA kernel
    (column-major activation scales, the weight scales' transpose): our call passes them at
    every 8B shape; row-major activation scales are refused by name before torch sees them."""
    for n, k in SHAPES_8B:
        x = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn, device="meta")
        x_s = empty_scales(m, k // 128, True, "meta")
        w_s = torch.empty(n // 128, k // 128, device="meta")
        assert fp8_scaled_mm.block_scaled_mm(x, x_s, w, w_s).shape == (m, n)
        if m > 1:
            with pytest.raises(ValueError, match="column-major"):
                fp8_scaled_mm.block_scaled_mm(x, empty_scales(m, k // 128, False, "meta"), w, w_s)
    assert "K/128 of 4" in fp8_scaled_mm.shape_problem(256, 640, (128, 128), torch.bfloat16)


# ---- the W8A8 reference and fp8_linear ----------------------------------------------------------


@pytest.mark.parametrize("block", [(32, 32), (16, 64), None])
def test_w8a8_reference_is_the_kernel_reference_of_the_quantized_input(block):
    w, s = _weights(96, 128, block)
    x = torch.randn(7, 128)
    group = block[1] if block else 128
    x_q, x_s = per_token_group_quant_ref(x, group)
    want = w8a8_matmul_ref(x_q, x_s, w, s, block, torch.float32)
    assert torch.allclose(w8a8_linear_ref(x, w, s, block), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block", [(32, 64), (16, 80)])
def test_w8a8_reference_with_a_partial_last_activation_group(block):
    """K = 96 is not a multiple of the group (64 + 32, 80 + 16): the last group's scale covers
    only its own columns, so the group can't be read off K / number of groups."""
    w, s = _weights(48, 96, block)
    x = torch.randn(5, 96)
    x_q, x_s = per_token_group_quant_ref(x, block[1])
    want = w8a8_matmul_ref(x_q, x_s, w, s, block, torch.float32)
    assert torch.allclose(w8a8_linear_ref(x, w, s, block), want, rtol=1e-6, atol=1e-6)
    pre = Fp8Activation(x_q, x_s, block[1], torch.float32)
    assert (pre.dequantize() - x).abs().max() <= x.abs().max() / 16  # FP8 rounding only


def test_fp8_linear_w8a8_ref_path_and_prequantized_input(fp8_gemm_env):
    block = (32, 32)
    w, s = _weights(64, 96, block)
    bias = torch.randn(64)
    x = torch.randn(5, 96)
    fp8_gemm_env("w8a8_ref")
    want = w8a8_linear_ref(x, w, s, block, None, bias)
    assert torch.equal(fl.fp8_linear(x, w, s, block, None, bias), want)
    x_q, x_s = per_token_group_quant_ref(x, 32)
    pre = Fp8Activation(x_q, x_s.t().contiguous().t(), 32, torch.float32)
    assert torch.allclose(fl.fp8_linear(pre, w, s, block, None, bias), want, atol=1e-6)
    with pytest.raises(ValueError, match="groups of 16 reached a layer with weight_block_size"):
        fl.fp8_linear(Fp8Activation(x_q, x_s, 16, torch.float32), w, s, block)


def test_fp8_linear_dequant_path_takes_a_prequantized_input(fp8_gemm_env):
    """Off the W8A8 paths a handed-over activation is dequantized first (not refused)."""
    w, s = _weights(64, 96, (32, 32))
    x = torch.randn(3, 96)
    x_q, x_s = per_token_group_quant_ref(x, 32)
    pre = Fp8Activation(x_q, x_s, 32, torch.float32)
    fp8_gemm_env("dequant")
    got = fl.fp8_linear(pre, w, s, (32, 32))
    assert torch.allclose(got, w8a8_linear_ref(x, w, s, (32, 32)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("static", [False, True])
def test_rowwise_scaled_mm_matches_reference_on_cpu(static):
    """compressed-tensors' GEMM: ``torch._scaled_mm`` with per-token x per-channel scales (or a
    static per-tensor input scale) against the W8A8 reference, bf16 output."""
    w, s = _weights(256, 512, None)
    x = torch.randn(9, 512, dtype=torch.bfloat16)
    bias = torch.randn(256, dtype=torch.bfloat16)
    if static:
        inp = torch.tensor([0.02])
        x_q = (x.float() / inp).clamp(-448, 448).to(torch.float8_e4m3fn)
        x_s = inp.view(1, 1).expand(9, 1).contiguous()
    else:
        inp = None
        x_q, x_s = per_token_group_quant_ref(x, 512)
    try:
        out = w8a8_rowwise_matmul(x_q, x_s, w, s, torch.bfloat16, bias)
    except (RuntimeError, NotImplementedError) as e:  # a torch build without the CPU kernel
        pytest.skip(f"torch._scaled_mm does not run on this CPU build: {e}")
    ref = w8a8_linear_ref(x, w, s, None, inp, bias).float()
    assert ((out.float() - ref).abs().max() / ref.abs().max()).item() < 1e-2  # bf16 rounding
