"""Host-side PDL switch (kernels/pdl.py): CPU tensors launch without PDL even when requested."""

from __future__ import annotations

import torch

from hf_paged import envs
from hf_paged.kernels import pdl


def test_cpu_tensors_launch_without_pdl(monkeypatch):
    monkeypatch.setattr(envs, "HF_PAGED_PDL", True)
    t = torch.zeros(2)
    assert not pdl.pdl_enabled(t)
    assert pdl.pdl_kwargs(t) == {"USE_PDL": False}
