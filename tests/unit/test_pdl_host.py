"""Host-side PDL helpers (kernels/pdl.py): the L2 prefetch sizing and the CPU fallback."""

from __future__ import annotations

import pytest
import torch

from hf_paged.kernels import pdl


@pytest.mark.parametrize(
    "num_rows,row_bytes,skip,budget,expected",
    [
        (4096, 8192, 1024, 8 * 2**20, 16),  # Llama-3-8B o_proj: 16 lines a row fit 8 MB
        (28672, 8192, 256, 8 * 2**20, 2),  # gate_up: 2.3 lines a row -> 2 (power of 2)
        (128256, 8192, 256, 8 * 2**20, 1),  # lm_head: under a line a row still gets 1
        (64, 256, 256, 8 * 2**20, 0),  # the first tile covers the row: nothing left
        (64, 1024, 256, 8 * 2**20, 4),  # 6 lines left -> 4, not past the row
        (4096, 8192, 1024, 0, 0),  # budget 0: prefetch off
    ],
)
def test_prefetch_lines(monkeypatch, num_rows, row_bytes, skip, budget, expected):
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", budget)
    lines = pdl.prefetch_lines(num_rows, row_bytes, skip)
    assert lines == expected
    if lines:
        assert lines & (lines - 1) == 0
        assert lines * pdl.L2_LINE <= row_bytes - skip


def test_cpu_tensors_launch_without_pdl(monkeypatch):
    monkeypatch.setattr(pdl, "_REQUESTED", True)
    t = torch.zeros(2)
    assert not pdl.pdl_enabled(t)
    assert pdl.pdl_kwargs(t) == {"USE_PDL": False}
