"""A depthwise causal convolution over a padded step (``padded.py``) with each sequence's last
``kernel - 1`` inputs carried in its slot.

Mamba 1/2, LFM2's short convolution and RecurrentGemma's recurrent block all start with one:
``out[t] = bias + sum_k weight[:, k] * x[t - (K - 1) + k]``, where inputs before the chunk come
from the slot's window (``[C, K - 1]``, oldest first; zeros for a sequence that starts here,
which is the causal zero padding of a whole-prompt convolution) and the new window is the last
``K - 1`` inputs of ``window + chunk``. Stock HF keeps the full ``K`` (or ``K - 1``, RecurrentGemma)
inputs; only the last ``K - 1`` are ever read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_paged.models.recurrent.base import RecurrentMeta
from hf_paged.models.recurrent.padded import PaddedLayout, initial_states


def causal_conv(
    x: torch.Tensor,  # [N, L, C], zero past each chunk's end
    weight: torch.Tensor,  # [C, K] (an nn.Conv1d's weight[:, 0, :])
    bias: torch.Tensor | None,  # [C]
    conv_states: torch.Tensor,  # [S + 1, C, K - 1], updated in place at meta.state_indices
    meta: RecurrentMeta,
    layout: PaddedLayout,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:  # [N, L, C] in x's dtype
    """The convolution of every sequence's chunk after its window; writes the new windows."""
    n, _, channels = x.shape
    width = weight.shape[1] - 1
    prev = initial_states(conv_states, meta)  # [N, C, K-1]
    ext = torch.cat([prev.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [N, C, K-1+L]
    out = F.conv1d(ext.to(weight.dtype), weight[:, None, :], bias, groups=channels)  # [N, C, L]
    if activation is not None:
        out = activation(out)
    # the chunk's last token sits at ext position K-2+len: the new window is len .. len+K-2
    pos = layout.seq_lens[:, None] + torch.arange(width, device=x.device)  # [N, K-1]
    new = ext.gather(2, pos[:, None, :].expand(n, channels, width))  # [N, C, K-1]
    conv_states.index_copy_(0, meta.state_indices, new.to(conv_states.dtype))
    return out.transpose(1, 2).to(x.dtype)
