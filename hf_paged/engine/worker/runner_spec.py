"""``RunnerSpec``: everything a rank needs to build its ``ModelRunner``, picklable (it crosses to
the tensor-parallel worker processes); and how errors name the model it describes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from hf_paged import envs as hf_envs
from hf_paged.config import EngineConfig
from hf_paged.models.protocol import UnsupportedModelError


@dataclass(frozen=True)
class RunnerSpec:
    """Everything a rank needs to build its runner; picklable (crosses to worker processes)."""

    config: EngineConfig
    hf_config: object  # transformers PretrainedConfig
    model_source: object  # checkpoint dir (str) or, on rank 0 only, an in-memory HF model
    device: str  # resolved: "cpu" or "cuda:N" (rank 0's; rank r uses cuda:N+r)
    dtype: torch.dtype
    max_model_len: int
    lora: object | None = None  # ``LoraSpec``: LoRA slots to build (``models/adapters``)
    autocast: object | None = None  # ``AutocastState`` the forward runs under (models/autocast)
    # every HF_PAGED_* switch as rank 0 read it (hf_paged/envs.py); each rank applies it
    envs: dict = field(default_factory=hf_envs.snapshot)

    @classmethod
    def from_runtime(cls, runtime, model_source) -> RunnerSpec:
        """The spec of an engine's runners (``runtime``: its ``RuntimeInfo``)."""
        return cls(
            config=runtime.config,
            hf_config=runtime.hf_config,
            model_source=model_source,
            device=runtime.device,
            dtype=runtime.dtype,
            max_model_len=runtime.max_model_len,
            lora=runtime.lora,
            autocast=runtime.autocast,
        )


def model_name(spec: RunnerSpec) -> str:
    """The model as memory errors name it: its architecture and ``max_model_len``."""
    archs = getattr(spec.hf_config, "architectures", None) or [type(spec.hf_config).__name__]
    return f"{archs[0]} (max_model_len={spec.max_model_len})"


@contextmanager
def refusals_named(hf_config) -> Iterator[None]:
    """A model path's refusal while building or loading says which model it refuses."""
    try:
        yield
    except UnsupportedModelError as e:
        archs = getattr(hf_config, "architectures", None) or []
        name = archs[0] if archs else str(getattr(hf_config, "model_type", "the model"))
        if name in str(e):
            raise
        raise UnsupportedModelError(f"{name}: {e}") from e
