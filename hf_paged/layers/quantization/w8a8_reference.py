"""The W8A8 reference of the FP8 linear layers: what every FP8 GEMM path computes, in fp32.

``w8a8_linear_ref``: the activation quantized exactly as the path quantizes it (per token and
``weight_block_size[1]`` group with block scales, per token with row-wise dynamic scales, one
static ``input_scale`` otherwise), dequantized, and multiplied in fp32 by the dequantized
weight. The cuBLASLt, Triton and GEMV paths differ from it only by fp32 summation order and
the output rounding.

``fake_quant_activations``: forward pre-hooks that make a stock transformers model with
dequantized weights (``FineGrainedFP8Config(dequantize=True)``, or the weights
``save_compressed_tensors_fp8`` returns) compute the same W8A8 function end to end; the tests'
and ``evaluation/bench_fp8.py``'s oracle for logits and greedy tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.kernels.fp8.fp8_gemm import dequantize_ref
from hf_paged.kernels.fp8.fp8_quant import (
    dequantize_activation_ref,
    per_token_group_quant_ref,
    static_quant_ref,
)


def fake_quant(
    x: torch.Tensor,  # [T, K]
    group: int | None,  # columns per scale; None = one per token
    input_scale: torch.Tensor | None = None,  # [1]: static per-tensor activations
) -> torch.Tensor:  # [T, K] fp32
    """The FP8 round trip of ``x`` as the FP8 linear layers quantize it (fp32)."""
    if input_scale is not None:
        return static_quant_ref(x, input_scale).float() * input_scale.float()
    group = group or x.shape[-1]
    q, s = per_token_group_quant_ref(x, group)
    return dequantize_activation_ref(q, s, group)


def w8a8_linear_ref(
    x: torch.Tensor,  # [T, K]
    weight: torch.Tensor,  # [N, K] fp8
    scale: torch.Tensor,  # block [ceil(N/bn), ceil(K/bk)] or rows [N, 1]
    block: tuple[int, int] | None,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [T, N] in x's dtype
    """``fake_quant(x) @ dequant(weight).T + bias`` in fp32, rounded once to x's dtype."""
    xq = fake_quant(x, block[1] if block is not None else None, input_scale)
    y = xq @ dequantize_ref(weight, scale, block, torch.float32).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fake_quant_activations(
    model: nn.Module, group: int | None, input_scales: dict[str, float] | None = None
) -> int:
    """Hook every linear layer of a stock HF model but its output head so that its input is
    replaced by ``fake_quant`` of it (``group`` columns per scale, None = per token; a module
    named in ``input_scales`` gets that static scale). Returns the number of hooked layers.

    With dequantized FP8 weights the model then computes the W8A8 reference: what the engine's
    FP8 layers compute, up to summation order and the dtype of the matmul.
    """
    head = model.get_output_embeddings()
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        static = (input_scales or {}).get(name)
        scale = None if static is None else torch.tensor([static], dtype=torch.float32)

        def hook(mod, args, scale=scale):
            (x,) = args
            flat = x.reshape(-1, x.shape[-1])
            s = None if scale is None else scale.to(x.device)
            return (fake_quant(flat, group, s).to(x.dtype).reshape(x.shape),)

        module.register_forward_pre_hook(hook)
        count += 1
    return count
