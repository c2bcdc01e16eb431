"""Backend choice by device (``hf_paged.attention.select_backend``): no CUDA, no Triton kernels."""

from __future__ import annotations

import pytest

from hf_paged.attention import select_backend
from hf_paged.attention.torch_batched import TorchBatchedBackend
from hf_paged.attention.torch_ref import TorchRefBackend


def test_triton_on_cpu_is_refused_by_name():
    """Asked for on CPU, the Triton backend is a ValueError naming the argument and what runs
    there (it built, then every forward raised triton's '0 active drivers')."""
    pytest.importorskip("triton")
    from triton import knobs

    if knobs.runtime.interpret:
        pytest.skip("triton's interpreter runs its kernels on CPU")
    with pytest.raises(ValueError, match=r"attention_backend='triton' is not allowed on device "
                                         r"'cpu'.*'torch' or None"):  # fmt: skip
        select_backend("cpu", "triton")
    assert isinstance(select_backend("cpu", None), TorchBatchedBackend)
    assert isinstance(select_backend("cpu", "torch"), TorchRefBackend)


def test_cpu_gets_the_batched_torch_backend():
    """Without CUDA the engine runs attention batched (one call per layer per step); the
    reference stays selectable by name as the oracle."""
    assert isinstance(select_backend("cpu", None), TorchBatchedBackend)
    assert isinstance(select_backend("cpu", "torch_batched"), TorchBatchedBackend)
    assert type(select_backend("cpu", "torch")) is TorchRefBackend
