"""FP8 linear layers: the parameters of a quantized parallel linear, their loaders, and the GEMM.

``Fp8LinearMethod.create_weights`` turns a ``layers.linear.LinearBase`` into an FP8 layer:

* ``weight`` ``[out, in]`` float8_e4m3fn (never dequantized in memory);
* the weight scale under its checkpoint name (``weight_scale_inv`` / ``weight_scale``), fp32:
  block scales ``[ceil(out / bn), ceil(in / bk)]``, else one per output row ``[out, 1]`` (a
  per-tensor checkpoint scale fills the rows of its shard, so fused q/k/v keep their own);
* with static activations, ``input_scale`` / ``activation_scale`` ``[1]``: the largest of the
  fused shards' scales (the shards share their input, as in vLLM).

Scales shard with what they scale: the loaders take the layer's ``shard_slice`` of the weight
and divide it by the block size, so a 128-row block belongs to the rank holding those rows. A
split that cuts a block (rows per rank or per fused shard not a multiple of ``bn``, columns per
rank not a multiple of ``bk``) is refused by name when the layer is built.

The GEMM (:func:`fp8_linear`, path by :func:`gemm_path`): on CUDA with compute capability
>= 8.9, the activation is quantized per token (per group of ``bk`` with block scales, scales
column-major; ``kernels/fp8/fp8_quant.py``), unless its producer handed it over quantized
(``Fp8Activation``), and multiplied by the path the measured table picks for the shape and row
count (``kernels/fp8/fp8_paths.json``): cuBLASLt block-wise (``kernels/fp8/fp8_scaled_mm.py``,
any row count: it pads the rows to a multiple of 4 inside), the Triton block kernel
(``kernels/fp8/fp8_gemm.py``) or the decode GEMV (``kernels/fp8/fp8_gemv.py``); row-wise scales
(compressed-tensors) go through ``torch._scaled_mm``. Every path computes the W8A8 reference
(``w8a8_reference.py``) up to summation order and output rounding. Elsewhere
"dequant": the weight dequantized for the call, then the model-dtype GEMM, which is what
transformers runs on such devices (it dequantizes the checkpoint at load).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from hf_paged import envs
from hf_paged.kernels.fp8 import fp8_gemm, fp8_gemv, fp8_paths, fp8_quant, fp8_scaled_mm
from hf_paged.layers.quantization.fp8_activation import Fp8Activation
from hf_paged.layers.quantization.fp8_config import Fp8Config
from hf_paged.layers.quantization.w8a8_reference import w8a8_linear_ref
from hf_paged.layers.shard import check_shape, read_shard

FP8_DTYPE = torch.float8_e4m3fn


def _param(*shape: int, dtype: torch.dtype, fill: float | None = None) -> nn.Parameter:
    t = torch.empty(*shape, dtype=dtype) if fill is None else torch.full(shape, fill, dtype=dtype)
    return nn.Parameter(t, requires_grad=False)


def loaded_dtype(loaded: Any) -> str:
    """``"float8_e4m3fn"`` / ``"bfloat16"`` ... of a tensor or a lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return str(loaded.dtype).removeprefix("torch.")
    names = {"F8_E4M3": "float8_e4m3fn", "BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    return names.get(loaded.get_dtype(), loaded.get_dtype())


def _check_block_split(layer, block: tuple[int, int]) -> None:
    """ValueError naming the layer's split when it cuts a scale block. At tp_size 1 only the
    fused shards before the last must hold whole blocks (the last block of a tensor may be
    partial, as transformers' scale shape ``ceil(N / bn)`` allows)."""
    bn, bk = block
    name = type(layer).__name__
    ids = layer.shard_ids()
    if layer.shard_slice(ids[0]).dim == 0:  # column parallel: the output rows are split
        for i, sid in enumerate(ids):
            s = layer.shard_slice(sid)
            if layer.tp_size == 1 and i == len(ids) - 1:
                continue
            if s.size % bn or s.dst % bn or s.src % bn:
                what = "" if sid is None else f" shard {sid!r}"
                hint = (
                    "use another tensor_parallel_size"
                    if layer.tp_size > 1
                    else "model_impl='generic' (or 'auto') serves it in HF's unfused modules"
                )
                raise ValueError(
                    f"{name}{what}: {s.size} rows per rank (from row {s.src} of {s.full}) is not "
                    f"a multiple of weight_block_size[0]={bn}: the split would cut an FP8 scale "
                    f"block; {hint}"
                )
    elif layer.tp_size > 1 and layer.input_size % bk:
        raise ValueError(
            f"{name}: {layer.input_size} input columns per rank is not a multiple of "
            f"weight_block_size[1]={bk}: the split would cut an FP8 scale block; use another "
            "tensor_parallel_size"
        )


class Fp8LinearMethod:
    """FP8 parameters and GEMM of one parallel linear (see the module docstring)."""

    def __init__(self, config: Fp8Config):
        self.config = config

    def create_weights(self, layer) -> None:
        """Replace ``layer.weight`` by a float8 one and add the scale parameters."""
        cfg = self.config
        out, inp = layer.output_size, layer.input_size
        layer.weight = _param(out, inp, dtype=FP8_DTYPE)
        layer.weight.weight_loader = functools.partial(self._load_weight, layer)
        if cfg.block is not None:
            _check_block_split(layer, cfg.block)
            bn, bk = cfg.block
            scale = _param(-(-out // bn), -(-inp // bk), dtype=torch.float32)
        else:
            scale = _param(out, 1, dtype=torch.float32)
        scale.weight_loader = functools.partial(self._load_scale, layer)
        setattr(layer, cfg.scale_name, scale)
        if cfg.input_scale_name is not None:
            input_scale = _param(1, dtype=torch.float32, fill=0.0)
            input_scale.weight_loader = self._load_input_scale
            setattr(layer, cfg.input_scale_name, input_scale)

    # ---- loaders ---------------------------------------------------------------------------

    def _load_weight(self, layer, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        dtype = loaded_dtype(loaded)
        if dtype != "float8_e4m3fn":
            raise ValueError(
                f"the weight is {dtype} but the quantization_config makes this layer FP8 "
                "(float8_e4m3fn); is it missing from modules_to_not_convert / ignore?"
            )
        layer.weight_loader(param, loaded, shard_id)

    def _load_scale(self, layer, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:

        s = layer.shard_slice(shard_id)
        shape = tuple(loaded.shape) if isinstance(loaded, torch.Tensor) else loaded.get_shape()
        if self.config.block is None:
            if math.prod(shape) == 1:  # per tensor ([], [1], [1, 1]): fill this shard's rows
                value = read_shard(loaded).reshape(()).float()
                rows = param.data if s.dim != 0 else param.data.narrow(0, s.dst, s.size)
                rows.fill_(value.item())
                return
            if s.dim != 0:  # a row-parallel layer's outputs are whole on every rank
                check_shape(loaded, param.shape)
                param.data.copy_(read_shard(loaded).float())
                return
            if tuple(shape) != (s.full,):  # [N, 1] (compressed-tensors) or [N]
                check_shape(loaded, (s.full, 1))
            part = read_shard(loaded, 0, s.src, s.size).float().reshape(-1, 1)
            param.data.narrow(0, s.dst, s.size).copy_(part)
            return
        bn, bk = self.config.block
        b = bn if s.dim == 0 else bk
        full = list(param.shape)
        if s.dim is not None:
            full[s.dim] = -(-s.full // b)
        check_shape(loaded, tuple(full))
        if s.dim is None:
            param.data.copy_(read_shard(loaded).float())
            return
        size = -(-s.size // b)  # the last shard of an unfused tensor may end in a partial block
        part = read_shard(loaded, s.dim, s.src // b, size).float()
        param.data.narrow(s.dim, s.dst // b, size).copy_(part)

    @staticmethod
    def _load_input_scale(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:

        value = read_shard(loaded).float().reshape(-1)
        if value.numel() != 1:
            raise ValueError(f"input scale has {value.numel()} values; one per tensor expected")
        param.data.copy_(torch.maximum(param.data, value))  # fused shards: the largest

    # ---- compute ---------------------------------------------------------------------------

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        cfg = self.config
        input_scale = getattr(layer, cfg.input_scale_name) if cfg.input_scale_name else None
        return fp8_linear(x, layer.weight, getattr(layer, cfg.scale_name), cfg.block,
                          input_scale, bias)  # fmt: skip


@functools.cache
def _fp8_gemm_device(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (8, 9)


def _gpu_fp8(device: torch.device) -> bool:
    return (
        device.type == "cuda"
        and fp8_gemm.triton is not None
        and _fp8_gemm_device(
            device.index if device.index is not None else torch.cuda.current_device()
        )
    )


def _block_path_ok(path: str, m: int, n: int, k: int, device, dtype, block) -> bool:
    """Whether block-scale path ``path`` takes these shapes on this device. cuBLASLt takes
    every row count ``m``: it needs M a multiple of 4 (the column-major activation scales'
    leading dimension), and ``fp8_scaled_mm.block_scaled_mm`` pads the rows up to that and
    slices the output back (``fp8_scaled_mm.pad_rows``); the weight shape is what it refuses."""
    if path == "cublaslt":
        return (
            fp8_scaled_mm.available()
            and fp8_scaled_mm.device_ok(device)
            and fp8_scaled_mm.shape_problem(n, k, block, dtype) is None
        )
    if path == "gemv":
        return 0 < m <= fp8_gemv.MAX_ROWS
    return path == "triton"


def gemm_path(m: int, n: int, k: int, device: torch.device, dtype: torch.dtype, block) -> str:
    """Which GEMM :func:`fp8_linear` runs for ``m`` rows of a ``[n, k]`` weight: one of
    ``PATHS``. ``HF_PAGED_FP8_GEMM`` (``hf_paged/envs.py``) may name one; otherwise, on CUDA
    with FP8 GEMMs, block-scaled weights take the measured choice of ``kernels/fp8/fp8_paths.json``
    (default: "cublaslt" where it takes the shape, else "triton"), row-wise ones "rowwise"."""
    forced = envs.HF_PAGED_FP8_GEMM
    if forced in ("w8a8_ref", "dequant"):
        return forced
    return _path(m, n, k, device, dtype, None if block is None else tuple(block), forced)


@functools.lru_cache(maxsize=8192)  # host cost per call: one dict lookup (prefill runs eagerly)
def _path(m: int, n: int, k: int, device: torch.device, dtype, block, forced: str) -> str:
    if not _gpu_fp8(device):
        return "dequant"
    if block is None:
        rowwise = dtype == torch.bfloat16 and n % 16 == 0 and k % 16 == 0
        return "rowwise" if rowwise else "dequant"
    bk = block[1]
    if bk < 16 or bk & (bk - 1):
        return "dequant"
    if forced != "auto" and _block_path_ok(forced, m, n, k, device, dtype, block):
        return forced
    choice = fp8_paths.lookup(n, k, m)
    if choice is not None and _block_path_ok(choice.path, m, n, k, device, dtype, block):
        return choice.path
    return "cublaslt" if _block_path_ok("cublaslt", m, n, k, device, dtype, block) else "triton"


PATHS = ("cublaslt", "triton", "gemv", "rowwise", "w8a8_ref", "dequant")


def quantizes_activations(device: torch.device) -> bool:
    """Whether FP8 layers with dynamic activations on ``device`` take FP8 activations (every
    path but "dequant" and "w8a8_ref"): then a producer may hand them an ``Fp8Activation``."""
    if envs.HF_PAGED_FP8_GEMM in ("w8a8_ref", "dequant"):
        return False
    return _gpu_fp8(device)


def input_group(layer) -> int | None:
    """The activation group an FP8 layer with dynamic activations quantizes its input in: its
    ``weight_block_size[1]`` with block scales, its whole input (one scale per token) with
    row-wise scales; None for plain layers and static activations. What a producer before it
    may quantize in."""
    method = getattr(layer, "quant_method", None)
    cfg = getattr(method, "config", None)
    if cfg is None or not cfg.dynamic:
        return None
    return cfg.block[1] if cfg.block is not None else layer.input_size


def _config(path: str, m: int, n: int, k: int):
    choice = fp8_paths.lookup(n, k, m)
    return choice.config if choice is not None and choice.path == path else None


def fp8_linear(
    x: torch.Tensor | Fp8Activation,  # [T, K]
    weight: torch.Tensor,  # [N, K] fp8
    scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)] or rows [N, 1], fp32
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None = None,  # [1]: static per-tensor activations
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [T, N] in x's dtype
    """``x @ dequant(weight).T + bias`` through the path :func:`gemm_path` picks. ``x`` may
    come quantized already (``Fp8Activation`` with groups of ``block[1]``).

    Raises:
        ValueError: an ``Fp8Activation`` whose group is not the layer's ``block[1]``.
    """
    pre = x if isinstance(x, Fp8Activation) else None
    m, k = x.shape
    n = weight.shape[0]
    dtype = pre.dtype if pre is not None else x.dtype
    path = gemm_path(m, n, k, x.device, dtype, block)
    if pre is not None and block is not None and pre.group != block[1]:
        raise ValueError(
            f"an activation quantized in groups of {pre.group} reached a layer with "
            f"weight_block_size={tuple(block)}: the producer must use the consumer's group"
        )
    per_token = pre is not None and pre.group >= k
    if pre is not None and (path == "dequant" or (path == "rowwise" and not per_token)):
        x, pre = pre.dequantize(), None  # these quantize (or not) themselves
    if path == "dequant":
        return torch.nn.functional.linear(x, fp8_gemm.dequantize_ref(weight, scale, block, x.dtype),
                                          bias)  # fmt: skip
    if path == "w8a8_ref":
        x = pre.dequantize() if pre is not None else x
        return w8a8_linear_ref(x, weight, scale, block, input_scale, bias)
    if path == "rowwise":
        if pre is not None:  # quantized per token by its producer
            return fp8_gemm.w8a8_rowwise_matmul(pre.q, pre.scale, weight, scale, dtype, bias)
        x = x if x.stride(-1) == 1 else x.contiguous()
        if input_scale is not None:  # static: one scale for every token
            x_q = fp8_quant.static_quant_ref(x, input_scale)
            x_s = input_scale.view(1, 1).expand(x.shape[0], 1).contiguous()
        else:
            x_q, x_s = fp8_quant.per_token_group_quant(x, x.shape[1])
        return fp8_gemm.w8a8_rowwise_matmul(x_q, x_s, weight, scale, x.dtype, bias)
    if pre is not None:
        x_q, x_s = pre.q, pre.scale
    else:
        x = x if x.stride(-1) == 1 else x.contiguous()
        x_q, x_s = fp8_quant.per_token_group_quant(x, block[1], column_major=True)
    if path == "cublaslt":
        return fp8_scaled_mm.block_scaled_mm(x_q, x_s, weight, scale, dtype, bias)
    if path == "gemv":
        return fp8_gemv.fp8_gemv(x_q, x_s, weight, scale, block, dtype, bias,
                                 config=_config("gemv", m, n, k))  # fmt: skip
    return fp8_gemm.w8a8_block_matmul(x_q, x_s, weight, scale, block, dtype, bias,
                                      config=_config("triton", m, n, k))  # fmt: skip
