"""Tensor-parallel linear layers (Megatron layout, as in nano-vllm / vLLM).

Column-parallel layers split the output features across ranks (no communication in forward);
row-parallel layers split the input features and ``all_reduce`` the partial products. A
column-parallel layer followed by a row-parallel one (qkv -> o, gate_up -> down) needs exactly
one all_reduce per pair.

Every parameter carries a ``weight_loader(param, loaded, shard_id=None)``. ``loaded`` is either a
full checkpoint tensor or a lazy ``safetensors`` slice (``safe_open(...).get_slice(name)``); the
loader reads only the rows/cols this rank holds (see ``read_shard``). Merged parameters
(``qkv_proj``, ``gate_up_proj``) also carry ``param.shard_ids``: the shard ids that must all be
loaded for the parameter to be complete.

Parameters are allocated with ``torch.empty`` in the current default dtype/device (no init work);
the caller scopes those (see ``hf_paged.models.registry.build_model``).

``quant`` (an ``hf_paged.layers.quantization.Fp8Config``) makes a layer FP8: its weight is
float8_e4m3fn, it gains the checkpoint's scale parameters, and its GEMM is the FP8 one
(``layers/quantization/fp8_linear.py``). Every loader shards through ``shard_slice``, so the
scales follow the rows / columns of the weight they scale.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hf_paged.distributed.communicator import Communicator
from hf_paged.kernels.skinny_gemm import linear
from hf_paged.layers.quantization.fp8_linear import Fp8LinearMethod
from hf_paged.layers.shard import ShardSlice, check_shape, divide, read_shard


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """Holds ``weight`` [out_per_rank, in_per_rank] and optional ``bias``; subclasses shard."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        comm: Communicator | None = None,
        quant=None,
    ):
        super().__init__()
        self.comm = comm or Communicator()
        self.tp_rank = self.comm.rank
        self.tp_size = self.comm.world_size
        self.input_size = input_size  # per rank
        self.output_size = output_size  # per rank
        self.weight = _empty_param(output_size, input_size)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = _empty_param(output_size)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.quant_method = None
        if quant is not None:  # FP8: float8 weight, scale parameters, the FP8 GEMM
            self.quant_method = Fp8LinearMethod(quant)
            self.quant_method.create_weights(self)

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        """Where checkpoint tensor ``shard_id`` lands on this rank (subclasses shard)."""
        raise NotImplementedError

    def shard_ids(self) -> tuple:
        """The checkpoint tensors the layer fuses, in order ((None,): one unfused tensor)."""
        return (None,)

    def _set_shard_ids(self, shard_ids: tuple) -> None:
        """Every parameter of a fused layer is complete once each of ``shard_ids`` loaded."""
        for param in self.parameters(recurse=False):
            param.shard_ids = shard_ids

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """Copy this rank's part of ``loaded`` (a full tensor or lazy slice) into ``param``."""
        s = self.shard_slice(shard_id)
        if s.dim is None or (param.dim() == 1 and s.dim == 1):  # replicated (a row bias)
            check_shape(loaded, param.shape)
            param.data.copy_(read_shard(loaded))
            return
        full = list(param.shape)
        full[s.dim] = s.full
        check_shape(loaded, tuple(full))
        dst = param.data.narrow(s.dim, s.dst, s.size)
        dst.copy_(read_shard(loaded, s.dim, s.src, s.size))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T (+ bias)``: [T, in] -> [T, out], FP8 when the layer is."""
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in] -> [T, out]
        return self.matmul(x, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}, "
            f"tp={self.tp_rank}/{self.tp_size}"
        )


class ReplicatedLinear(LinearBase):
    """Full weight on every rank."""

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        return ShardSlice(None, 0, 0, self.output_size, self.output_size)


class ColumnParallelLinear(LinearBase):
    """Output features split evenly: rank r holds rows [r*out/tp, (r+1)*out/tp)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        comm: Communicator | None = None,
        quant=None,
    ):
        tp_size = comm.world_size if comm is not None else 1
        self.full_output_size = output_size
        size = divide(output_size, tp_size, "output_size")
        super().__init__(input_size, size, bias, comm, quant)

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        size = self.output_size
        return ShardSlice(0, 0, self.tp_rank * size, size, self.full_output_size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of one input fused into one matmul (gate_up_proj).

    Shard ``i`` (an int) is checkpoint tensor ``i``; on each rank the local weight is the
    concatenation of every shard's local rows.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        comm: Communicator | None = None,
        quant=None,
    ):
        self.output_sizes = list(output_sizes)
        for size in self.output_sizes:
            divide(size, comm.world_size if comm is not None else 1, "output_sizes[i]")
        super().__init__(input_size, sum(output_sizes), bias, comm, quant)
        self._set_shard_ids(self.shard_ids())

    def shard_ids(self) -> tuple:
        return tuple(range(len(self.output_sizes)))

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        ids = tuple(range(len(self.output_sizes)))
        if shard_id not in ids:
            raise ValueError(f"shard_id={shard_id!r} is not allowed: must be one of {ids}")
        offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        size = self.output_sizes[shard_id] // self.tp_size
        return ShardSlice(0, offset, self.tp_rank * size, size, self.output_sizes[shard_id])


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; heads split across ranks.

    Query heads split evenly. KV heads split evenly when ``total_num_kv_heads >= tp_size``;
    otherwise each kv head is replicated on ``tp_size / total_num_kv_heads`` ranks and rank r holds
    kv head ``r * total_num_kv_heads // tp_size`` (so it serves exactly the q heads it holds).
    Local layout: [q heads | k heads | v heads], each ``head_size`` wide.
    """

    def __init__(
        self,
        hidden_size: int,
        head_size: int,
        total_num_heads: int,
        total_num_kv_heads: int,
        bias: bool,
        comm: Communicator | None = None,
        quant=None,
    ):
        tp_size = comm.world_size if comm is not None else 1
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if total_num_kv_heads >= tp_size:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size, "num_key_value_heads")
        else:  # replicate: tp_size must be a multiple of the kv head count
            if tp_size % total_num_kv_heads != 0:
                raise ValueError(
                    f"tp_size={tp_size} is not a multiple of num_key_value_heads="
                    f"{total_num_kv_heads}"
                )
            self.num_kv_heads = 1
        output_size = (self.num_heads + 2 * self.num_kv_heads) * head_size * tp_size
        super().__init__(hidden_size, output_size, bias, comm, quant)
        self._set_shard_ids(self.shard_ids())

    def shard_ids(self) -> tuple:
        return ("q", "k", "v")

    @property
    def q_size(self) -> int:  # per rank
        return self.num_heads * self.head_size

    @property
    def kv_size(self) -> int:  # per rank
        return self.num_kv_heads * self.head_size

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        d = self.head_size
        if shard_id == "q":
            offset, size, total = 0, self.q_size, self.total_num_heads * d
            start = self.tp_rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, total = self.kv_size, self.total_num_kv_heads * d
            # same formula whether kv heads are split or replicated
            start = (self.tp_rank * self.total_num_kv_heads // self.tp_size) * d
        else:
            raise ValueError(f"shard_id={shard_id!r} is not allowed: must be 'q', 'k' or 'v'")
        return ShardSlice(0, offset, start, size, total)


class RowParallelLinear(LinearBase):
    """Input features split evenly; partial outputs summed with an all_reduce.

    The bias is held in full on every rank and added once, after the reduce.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        comm: Communicator | None = None,
        quant=None,
    ):
        tp_size = comm.world_size if comm is not None else 1
        self.full_input_size = input_size
        size = divide(input_size, tp_size, "input_size")
        super().__init__(size, output_size, bias, comm, quant)

    def shard_slice(self, shard_id: Any = None) -> ShardSlice:
        size = self.input_size
        return ShardSlice(1, 0, self.tp_rank * size, size, self.full_input_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, in/tp] -> [T, out]
        y = self.matmul(x, None)
        y = self.comm.all_reduce(y)
        if self.bias is not None:
            y = y + self.bias
        return y
