"""The contract between a recurrent token mixer and the engine's per-sequence state pool.

A mixer replaces one HF recurrent layer (its module's own parameters, shared, not copied) and
runs it on the engine's flattened step: ``hidden [T, D]`` holds the step's sequences one after
another in the scheduler's order (prefill chunks and single-token decodes interleaved: running
sequences first, then newly admitted ones), with no padding. Each sequence owns a
slot of the state pool; the mixer reads the slot's states when ``has_initial_state`` (the
sequence has computed tokens before this chunk) and writes the states after the chunk's last
token back into the same slot, in place. Slot 0 is a dummy that padded rows of a CUDA graph
write into; real sequences never get it.

States are declared per layer (``state_specs``) so that the engine can reserve
``max_num_seqs`` slots of each before it sizes the KV blocks. A family whose reference keeps a
state in fp32 declares fp32 there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StateSpec:
    """One state tensor of a layer, per slot."""

    name: str  # "conv", "recurrent", "ssm", ...: the key in the ``states`` dict
    shape: tuple[int, ...]  # per slot, e.g. (conv_dim, kernel - 1) or (heads, k_dim, v_dim)
    dtype: torch.dtype


@dataclass
class RecurrentMeta:
    """The step's sequences as the mixers see them (built once per step by the runner)."""

    cu_seqlens: torch.Tensor  # [N + 1] int32, on the device: sequence i is rows cu[i]:cu[i+1]
    state_indices: torch.Tensor  # [N] int64: sequence i's slot in the pool (never 0)
    has_initial_state: torch.Tensor  # [N] bool: the slot holds the state before this chunk
    num_prefills: int  # sequences of more than one token (0: a decode-only step, CUDA-graph safe)
    seq_lens: list[int]  # [N] host copy of the chunk lengths (no device sync to read them)


class RecurrentMixer(nn.Module):
    """A recurrent layer on the paged engine. Subclasses wrap one HF module (``from_hf``)."""

    def state_specs(self) -> list[StateSpec]:
        """The states one sequence needs in this layer."""
        raise NotImplementedError

    def forward(
        self, hidden: torch.Tensor, meta: RecurrentMeta, states: dict[str, torch.Tensor]
    ) -> torch.Tensor:
        """``hidden [T, D]`` -> ``[T, D]``; ``states[name]`` is ``[num_slots + 1, *spec.shape]``
        and is read and updated in place at ``meta.state_indices``."""
        raise NotImplementedError

    def hf_result(self, out: torch.Tensor):
        """What the wrapped HF module's forward returns, given the mixer's output ``out
        [1, T, D]``: ``out`` itself unless overridden (MiniMax's lightning attention returns
        ``(out, None)``, as its HF module does)."""
        return out
