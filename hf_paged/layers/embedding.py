"""Vocab-parallel token embedding and LM head.

The vocabulary is padded up to a multiple of ``tp_size`` and split into equal contiguous ranges;
rank r holds rows ``[r * V_pad / tp, (r + 1) * V_pad / tp)``. Padding rows are zero and padded
logit columns are sliced off, so callers only ever see ``num_embeddings`` entries.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_paged.distributed.communicator import Communicator
from hf_paged.kernels.skinny_gemm import linear
from hf_paged.layers.linear import check_shape, read_shard


class VocabParallelEmbedding(nn.Module):
    """Token embedding whose rows are split across ranks.

    Forward looks up the ids this rank owns, zeroes the rest, and sums over ranks (all_reduce).

    Args:
        num_embeddings: vocabulary size (unpadded).
        embedding_dim: hidden size.
        comm: the tensor-parallel communicator; None means a single rank.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, comm: Communicator | None = None):
        super().__init__()
        self.comm = comm or Communicator()
        self.tp_rank = self.comm.rank
        self.tp_size = self.comm.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_rank = padded // self.tp_size
        self.vocab_start = self.tp_rank * self.num_embeddings_per_rank
        self.vocab_end = self.vocab_start + self.num_embeddings_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.num_embeddings_per_rank, embedding_dim), requires_grad=False
        )
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        check_shape(loaded, (self.num_embeddings, self.embedding_dim))
        # rows of the real vocabulary that fall in this rank's range
        size = max(0, min(self.vocab_end, self.num_embeddings) - self.vocab_start)
        if size > 0:
            param.data[:size].copy_(read_shard(loaded, 0, self.vocab_start, size))
        param.data[size:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = (input_ids - self.vocab_start) * mask
        y = F.embedding(local_ids, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        y = self.comm.all_reduce(y)
        return y

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, "
            f"rows=[{self.vocab_start}, {self.vocab_end}), tp={self.tp_rank}/{self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection hidden -> vocab logits, vocab split across ranks like the embedding.

    ``forward`` returns the complete ``[N, vocab]`` logits on rank 0 and None on other ranks.
    For tied embeddings, assign the embedding's Parameter to ``self.weight``.
    """

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # [N, hidden]
        logits = linear(hidden, self.weight)  # [N, vocab_per_rank]
        logits = self.comm.gather_last_dim(logits)  # [N, vocab_padded] on rank 0, else None
        if logits is None:
            return None
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits
