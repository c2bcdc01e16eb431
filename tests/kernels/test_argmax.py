"""Row-wise argmax kernel vs ``torch.argmax`` under Triton's CPU interpreter (a child process,
like tests/kernels/test_paged_attention.py): ties (first index wins), NaN (first NaN wins), rows
of -inf, V across chunk boundaries, several rows, strided rows. GPU cases with bf16 and the
Llama-3 vocabulary are in tests/kernels/test_fused.py."""

from __future__ import annotations

import pytest

from tests.kernels.interpret_utils import interpret_main


def _make(kind, b, v, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(b * 31 + v)
    x = torch.randn(b, v + 3, generator=gen)[:, :v]  # row stride v + 3
    if kind == "ties":  # the maximum repeated in several chunks, and in the first chunk twice
        x = x.clamp(max=1.0)
        for c in (v - 1, 7, 5, v // 2):
            x[:, c] = 5.0
    elif kind == "nan":  # NaN after the max, twice; torch takes the first NaN
        x[:, 3] = 9.0
        x[:, v - 2] = float("nan")
        x[0, v // 3] = float("nan")
    elif kind == "ninf":
        x[:] = float("-inf")
    elif kind == "inf":
        x[:, v - 1] = float("inf")
        x[:, 1] = float("inf")
    return x.to(dtype)


def _case(kind, b, v, dtype_name):
    from hf_paged.kernels.argmax import argmax

    x = _make(kind, b, v, dtype_name)
    got = argmax(x)
    want = x.argmax(dim=-1)
    assert got.dtype == want.dtype and got.shape == want.shape
    return float((got != want).sum().item())  # rows that differ


CASES = [
    ("random", 1, 10000, "float16"),
    ("random", 3, 4096, "float32"),
    ("random", 2, 4097, "float16"),
    ("ties", 2, 9000, "float32"),
    ("nan", 2, 9000, "float32"),
    ("ninf", 2, 5000, "float16"),
    ("inf", 1, 8193, "float32"),
    ("random", 1, 1, "float32"),
]


def _cases():
    return {f"{k}_b{b}_v{v}_{d}": (_case, (k, b, v, d)) for k, b, v, d in CASES}




@pytest.mark.parametrize("name", list(_cases()))
def test_argmax_matches_torch(interpreted, name):
    value = interpreted[name]
    assert value == 0.0, f"{name}: {value} rows differ from torch.argmax"


def test_rejects_what_it_cannot_take():
    import torch

    from hf_paged.kernels.argmax import argmax, argmax_rows

    with pytest.raises(ValueError, match=r"non-empty \[B, V\]"):
        argmax(torch.zeros(3))
    with pytest.raises(ValueError, match="fp16, bf16 or fp32"):
        argmax(torch.zeros(2, 5, dtype=torch.int32))
    x = torch.randn(2, 7)  # CPU: argmax_rows is torch's
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


if __name__ == "__main__":
    interpret_main(_cases())
