"""Make FP8 checkpoints from plain ones (tests and benchmarks: no FP8 checkpoint can be
downloaded here).

* :func:`load_finegrained_fp8`: transformers' own quantizer (``FineGrainedFP8Config``) applied
  while loading a plain checkpoint; ``save_pretrained`` of the result is the fine-grained FP8
  format. transformers refuses to quantize without a GPU, so on CPU its environment check is
  skipped for the call (the quantization itself is plain torch).
* :func:`save_compressed_tensors_fp8`: our writer of compressed-tensors' FP8 formats
  ("-FP8-dynamic": per-channel weight scales, dynamic per-token activations; "-FP8": per-tensor
  weight scales and a static per-tensor ``input_scale``), with its ``quantization_config``.
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
from torch import nn

FP8_MAX = 448.0


@contextlib.contextmanager
def _quantizer_on_cpu():
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    original = FineGrainedFP8HfQuantizer.validate_environment
    if torch.cuda.is_available():
        yield
        return
    FineGrainedFP8HfQuantizer.validate_environment = lambda self, *a, **k: None
    try:
        yield
    finally:
        FineGrainedFP8HfQuantizer.validate_environment = original


def load_finegrained_fp8(
    path: str | os.PathLike,
    weight_block_size: tuple[int, int] | None = (128, 128),
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    **config_kwargs,
):
    """The plain checkpoint at ``path`` quantized in memory by transformers'
    ``FineGrainedFP8Config`` (its ``FP8Linear`` modules: float8 ``weight``, fp32
    ``weight_scale_inv``)."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    qc = FineGrainedFP8Config(weight_block_size=weight_block_size, **config_kwargs)
    with _quantizer_on_cpu():
        return AutoModelForCausalLM.from_pretrained(
            os.fspath(path), quantization_config=qc, dtype=dtype, device_map=device
        ).eval()


def _ct_quantize(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """compressed-tensors' symmetric float8 quantization: ``scale = amax / 448`` per output
    channel ([N, 1]) or per tensor ([1]); ``q = float8(clamp(w / scale))``."""
    wf = w.float()
    if strategy == "channel":
        amax = wf.abs().amax(dim=1, keepdim=True)
    else:
        amax = wf.abs().amax().reshape(1)
    scale = amax.clamp(min=1e-12) / FP8_MAX
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def compressed_tensors_config(strategy: str, dynamic: bool, ignore: list[str]) -> dict:
    """The ``quantization_config`` llm-compressor writes for FP8 (``strategy="tensor"``,
    static) and FP8_DYNAMIC (``strategy="channel"``, dynamic)."""

    def args(strat, dyn):
        return {"num_bits": 8, "type": "float", "symmetric": True, "strategy": strat,
                "dynamic": dyn, "group_size": None, "block_structure": None, "actorder": None,
                "observer": None if dyn else "minmax", "observer_kwargs": {}}  # fmt: skip

    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": args(strategy, False),
                "input_activations": args("token" if dynamic else "tensor", dynamic),
                "output_activations": None,
            }
        },
        "ignore": list(ignore),
        "kv_cache_scheme": None,
    }


@torch.no_grad()
def save_compressed_tensors_fp8(
    model: nn.Module,
    path: str | os.PathLike,
    strategy: str = "channel",
    dynamic: bool = True,
    ignore: tuple[str, ...] = ("lm_head",),
    input_scales: dict[str, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Save a plain HF causal LM as a compressed-tensors FP8 checkpoint at ``path``.

    Every ``nn.Linear`` not named in ``ignore`` (exact name or last component) gets a float8
    ``weight`` and a ``weight_scale`` in the model dtype; static checkpoints (``dynamic=False``)
    also an ``input_scale`` (``input_scales[module]``, default 1.0). Returns the dequantized
    weights ``{param name: weight.float() * weight_scale}`` (what a loader must reproduce).

    Raises:
        ValueError: ``strategy`` not "channel" / "tensor", or "channel" with ``dynamic=False``
            (not a preset this writer knows).
    """
    from safetensors.torch import save_file

    if strategy not in ("channel", "tensor"):
        raise ValueError(f"strategy={strategy!r} is not allowed: must be 'channel' or 'tensor'")
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    dequantized = {}
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    for name, module in model.named_modules():
        if type(module) is not nn.Linear or name.split(".")[-1] in ignore or name in ignore:
            continue
        q, scale = _ct_quantize(module.weight, strategy)
        scale = scale.to(dtype)  # llm-compressor stores the scales in the model dtype
        state[f"{name}.weight"] = q
        state[f"{name}.weight_scale"] = scale
        dequantized[f"{name}.weight"] = q.float() * scale.float()
        if not dynamic:
            value = (input_scales or {}).get(name, 1.0)
            state[f"{name}.input_scale"] = torch.tensor([value], dtype=dtype)
    if getattr(model.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = compressed_tensors_config(strategy, dynamic, list(ignore))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(path)
    return dequantized
