"""The FP8 GEMM path ``fp8_linear`` picks on this GPU against the W8A8 torch reference and the
W8A16 (dequantized-weight) matmul, at the tiny test model's and the 8B model's shapes.

Separates kernel error (against W8A8: bf16 output rounding, ~1.6e-3 on the H200) from what
activation quantization itself costs (W8A8 against W8A16, ~2.5e-2 relative per linear).

Usage (GPU): PYTHONPATH=. python evaluation/diag_fp8_gemm.py
"""

import torch

from hf_paged.kernels.fp8.fp8_gemm import dequantize_ref, w8a8_matmul_ref
from hf_paged.kernels.fp8.fp8_quant import per_token_group_quant, per_token_group_quant_ref
from hf_paged.layers.quantization.fp8_linear import fp8_linear, gemm_path


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def main() -> None:
    torch.manual_seed(0)
    for n, k in [(512, 256), (256, 256), (1024, 256), (256, 512), (4096, 4096)]:
        w = torch.randn(n, k, device="cuda") * 0.05
        bs = (128, 128)
        s = w.abs().reshape(n // 128, 128, k // 128, 128).amax(dim=(1, 3)) / 448
        wq = (w / s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
        for m in (1, 5, 8, 11, 17, 23, 26, 64):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            out = fp8_linear(x, wq, s, bs).float()
            xq, xs = per_token_group_quant_ref(x, 128)
            ref = w8a8_matmul_ref(xq, xs, wq, s, bs, torch.float32)
            a16 = x.float() @ dequantize_ref(wq, s, bs, torch.float32).T
            kq, ks = per_token_group_quant(x, 128)
            qeq = (kq.float() == xq.float()).float().mean().item()
            print(
                f"n={n} k={k} m={m} path={gemm_path(m, n, k, x.device, x.dtype, bs)} rel_vs_w8a8ref={rel(out, ref):.2e} "
                f"rel_vs_w8a16={rel(out, a16):.2e} w8a8ref_vs_w8a16={rel(ref, a16):.2e} quant_eq={qeq:.4f} "
                f"scale_eq={torch.allclose(ks, xs, rtol=1e-6)}"
            )


if __name__ == "__main__":
    main()
