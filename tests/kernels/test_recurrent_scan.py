"""Mamba 1's selective scan and RG-LRU's linear scan: the Triton kernels == their torch
references under Triton's CPU interpreter (fp32 and bf16 inputs, fp32 states): ragged channel
counts, a state size off a power of two, strided views, positions where the state must hold
(``dt = 0`` / ``a = 1, x = 0``) and a single-position (decode) walk; and the Falcon-Mamba and
RecurrentGemma mixers with the kernels switched in == stock.

``TRITON_INTERPRET=1`` must be set before triton is imported, so the checks run in one child
process (this file run as a script) that prints ``{case: relative_error}`` as JSON.
"""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main

TOL = 1e-5  # fp32 accumulation both ways: exp and summation order only


def _rel(out, ref) -> float:
    import torch

    if out.shape != ref.shape or not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def _selective(n, length, channels, d_state, dtype, strided):
    import torch

    from hf_paged.kernels.recurrent_scan import selective_scan_ref, selective_scan_triton

    g = torch.Generator().manual_seed(channels + length)
    xz = torch.randn(n, length, 2 * channels, generator=g).to(dtype)
    x = xz[..., :channels] if strided else xz[..., :channels].contiguous()
    dt = torch.rand(n, length, channels, generator=g) * 0.5
    dt[0, length // 2 :] = 0.0  # a chunk that ends early: its state holds
    a = -torch.rand(channels, d_state, generator=g) * 4
    bc = torch.randn(n, length, 3 * d_state, generator=g).to(dtype)
    b, c = bc[..., :d_state], bc[..., d_state : 2 * d_state]  # views, as torch.split gives
    h = torch.randn(n, channels, d_state, generator=g)
    y, h1 = selective_scan_triton(x, dt, a, b, c, h)
    y_ref, h_ref = selective_scan_ref(x, dt, a, b, c, h)
    return max(_rel(y, y_ref), _rel(h1, h_ref))


def _linear(n, length, width, dtype):
    import torch

    from hf_paged.kernels.recurrent_scan import linear_scan_ref, linear_scan_triton

    g = torch.Generator().manual_seed(width + length)
    a = torch.rand(n, length, width, generator=g).to(dtype)
    x = torch.randn(n, length, width, generator=g).to(dtype)
    a[-1, length // 2 :], x[-1, length // 2 :] = 1.0, 0.0  # the state holds
    h = torch.randn(n, width, generator=g)
    out, h1 = linear_scan_triton(a, x, h)
    out_ref, h_ref = linear_scan_ref(a, x, h)
    return max(_rel(out, out_ref), _rel(h1, h_ref))


def _mixer(family):
    """A family's mixer with the kernels switched in (CPU tensors under the interpreter) ==
    stock: whole prompt, a mixed step, decode after prefill (0.0, or an AssertionError)."""
    from hf_paged.kernels import recurrent_scan
    from tests.models.recurrent import ssm_cases as cases

    recurrent_scan.supports = lambda *tensors: True
    module, config = cases.build_module(family)
    mixer = cases.mixer_for(family, module)
    cases.check_whole(mixer, module, length=12)
    cases.check_mixed(mixer, module)
    cases.check_decode(mixer, module, config, prompt_len=6, steps=3)
    return 0.0


def _cases() -> dict:
    import torch

    f32, bf16 = torch.float32, torch.bfloat16
    return {
        "selective_fp32": (_selective, (3, 9, 40, 16, f32, False)),
        "selective_bf16_strided": (_selective, (2, 7, 24, 16, bf16, True)),
        "selective_state_12": (_selective, (2, 5, 33, 12, f32, True)),
        "selective_decode": (_selective, (4, 1, 40, 16, f32, False)),
        "linear_fp32": (_linear, (3, 9, 300, f32)),
        "linear_bf16": (_linear, (2, 6, 96, bf16)),
        "linear_decode": (_linear, (5, 1, 64, f32)),
        # last: they switch the kernels in for the whole process
        "mixer_falcon_mamba": (_mixer, ("falcon_mamba",)),
        "mixer_recurrent_gemma": (_mixer, ("recurrent_gemma",)),
    }




@pytest.mark.parametrize(
    "case",
    ["selective_fp32", "selective_bf16_strided", "selective_state_12", "selective_decode",
     "linear_fp32", "linear_bf16", "linear_decode", "mixer_falcon_mamba",
     "mixer_recurrent_gemma"],
)  # fmt: skip
def test_kernel_matches_reference(interpreted, case):
    value = interpreted[case]
    assert value < TOL, f"{case}: relative error {value}"


if __name__ == "__main__":
    interpret_main(_cases())
