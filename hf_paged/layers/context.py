"""What a model needs to know about where it runs, passed to every layer's constructor.

It sits below ``layers/`` and ``models/`` (it imports neither), so both may take it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from hf_paged.attention.base import AttentionBackend, AttentionLayerSpec
from hf_paged.distributed.communicator import Communicator

logger = logging.getLogger(__name__)


@dataclass
class ModelContext:
    """The attention backend, the tensor-parallel communicator and the KV block size.

    ``backend_for`` gives each attention layer the backend that can compute it: the chosen one,
    or the torch reference for a layer the chosen one reports a problem with (the reason is kept
    in ``fallbacks``, and decode then runs eagerly: see ``supports_cuda_graph``).
    """

    attn_backend: AttentionBackend
    comm: Communicator = field(default_factory=Communicator)
    kv_block_size: int = 16
    fallbacks: dict[int, str] = field(default_factory=dict)  # KV layer -> why the torch ref
    max_model_len: int | None = None  # longest sequence the engine runs (None: not known)

    @property
    def tp_rank(self) -> int:
        return self.comm.rank

    @property
    def tp_size(self) -> int:
        return self.comm.world_size

    @property
    def supports_cuda_graph(self) -> bool:
        """Every layer's backend may be captured in a decode CUDA graph."""
        return self.attn_backend.supports_cuda_graph and not self.fallbacks

    def backend_for(self, layer_idx: int, spec: AttentionLayerSpec) -> AttentionBackend:
        """The backend for KV layer ``layer_idx``; the dtype is the current default (the one
        ``build_model`` scopes for the model's parameters)."""
        problem = self.attn_backend.problem(spec, torch.get_default_dtype(), self.kv_block_size)
        if problem is None:
            return self.attn_backend
        from hf_paged.attention.torch_ref import TorchRefBackend

        logger.warning(
            "attention layer %d: the %s backend cannot compute it (%s); using the torch "
            "reference for it", layer_idx, self.attn_backend.name, problem,
        )  # fmt: skip
        self.fallbacks[layer_idx] = problem
        return TorchRefBackend()
