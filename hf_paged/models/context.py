"""What a model needs to know about where it runs, passed to every layer's constructor."""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_paged.attention.base import AttentionBackend
from hf_paged.distributed.communicator import Communicator


@dataclass
class ModelContext:
    attn_backend: AttentionBackend
    comm: Communicator = field(default_factory=Communicator)

    @property
    def tp_rank(self) -> int:
        return self.comm.rank

    @property
    def tp_size(self) -> int:
        return self.comm.world_size
