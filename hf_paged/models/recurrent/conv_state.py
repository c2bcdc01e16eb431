"""A depthwise causal convolution over the engine's flattened varlen step, with a carried window.

Each sequence's slot keeps the last ``kernel - 1`` inputs of the layer (``[C, kernel - 1]``,
oldest first): a chunk convolves them followed by its own inputs and writes the new last
``kernel - 1`` back. A slot without ``has_initial_state`` starts from zeros (the causal padding
of a whole-prompt convolution).

* ``conv_step``: one token per sequence (decode), no host reads (CUDA-graph safe).
* ``conv_varlen``: sequences of any length in one ``F.conv1d`` over the step: each sequence's
  inputs are preceded by its own window, so no output window crosses two sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _initial(conv_states, state_indices, has_initial_state) -> torch.Tensor:
    prev = conv_states.index_select(0, state_indices)  # [N, C, K-1]
    return torch.where(has_initial_state[:, None, None], prev, torch.zeros_like(prev))


def conv_step(
    x: torch.Tensor,  # [N, C]: one token per sequence
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_states: torch.Tensor,  # [S + 1, C, K-1], updated in place
    state_indices: torch.Tensor,  # [N] int64
    has_initial_state: torch.Tensor,  # [N] bool
) -> torch.Tensor:  # [N, C], before the activation
    prev = _initial(conv_states, state_indices, has_initial_state)
    window = torch.cat([prev, x[:, :, None].to(prev.dtype)], dim=-1)  # [N, C, K]
    out = (window.to(weight.dtype) * weight).sum(dim=-1)
    if bias is not None:
        out = out + bias
    conv_states.index_copy_(0, state_indices, window[:, :, 1:])
    return out.to(x.dtype)


def conv_varlen(
    x: torch.Tensor,  # [T, C]
    weight: torch.Tensor,  # [C, K]
    bias: torch.Tensor | None,  # [C]
    conv_states: torch.Tensor,  # [S + 1, C, K-1], updated in place
    state_indices: torch.Tensor,  # [N] int64
    has_initial_state: torch.Tensor,  # [N] bool
    seq_lens: list[int],  # [N] host
) -> torch.Tensor:  # [T, C], before the activation
    n, t = len(seq_lens), x.shape[0]
    width = weight.shape[1] - 1
    prev = _initial(conv_states, state_indices, has_initial_state)  # [N, C, K-1]
    # rows of ext = [prev of every sequence (N * (K-1)) | x (T)], arranged per sequence as
    # [prev_i, x_i]; out_pos[r]: where row r's window ends in ext
    order: list[int] = []
    out_pos: list[int] = []
    last: list[int] = []  # per sequence, the ext positions of its new window
    row = 0
    for i, length in enumerate(seq_lens):
        base = len(order)
        order.extend(t + i * width + j for j in range(width))
        order.extend(range(row, row + length))
        out_pos.extend(range(base + width, base + width + length))
        end = base + width + length
        last.extend(range(end - width, end))
        row += length
    idx = torch.tensor(order + out_pos + last, dtype=torch.long).to(x.device)
    e, o = len(order), len(out_pos)
    src = torch.cat([x.to(prev.dtype), prev.transpose(1, 2).reshape(n * width, -1)])
    ext = src.index_select(0, idx[:e])  # [E, C]
    out = F.conv1d(ext.T[None].to(weight.dtype), weight[:, None, :], bias, groups=weight.shape[0])
    out = out[0].T.index_select(0, idx[e : e + o] - width)  # [T, C]
    new = ext.index_select(0, idx[e + o :]).view(n, width, -1).transpose(1, 2)
    conv_states.index_copy_(0, state_indices, new.to(conv_states.dtype))
    return out.to(x.dtype)
