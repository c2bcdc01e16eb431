"""Mixed precision as accelerate sets it: the engine's forward under the model's own autocast.

accelerate's ``prepare_model`` (a trainer's ``bf16=True``, TRL's default) puts
``torch.autocast(device, dtype=torch.bfloat16)`` around the model's forward, over float32
weights. Stock ``generate`` then computes every step under that autocast. The engine reproduces
it by running its own forward and output head under the same ``torch.autocast`` (on every rank:
the state travels in the runner spec), so autocast treats the engine's ops as it treats stock's.
For the Llama family on the CPU (bf16 autocast, fp32 weights) that is, op for op:

* linear layers (HF's q/k/v/o, gate/up/down, lm_head; the engine's fused qkv and gate_up are the
  same rows of the same weights): input and weight cast to bf16, bf16 out;
* RMSNorm: float32 statistics; its output is ``fp32 weight * bf16(normalized)`` for a bf16 input
  (Qwen3's q/k norms), float32 for a float32 one (the residual stream);
* RoPE: cos/sin in the float32 dtype of the embeddings, so rotated q/k are float32 and v is bf16;
  the paged KV cache stays float32 and holds exactly those values;
* attention: ``scaled_dot_product_attention`` is on autocast's lower-precision list: q, k and v
  are cast to bf16 at the call, in stock's sdpa and in the engine's batched CPU attention alike
  (bf16 in, float32 accumulation and softmax inside the kernel, bf16 out);
* residual adds: float32 + bf16 -> float32 (type promotion, no autocast);
* logits: bf16 from the head, cast to float32 (accelerate's ``convert_outputs_to_fp32``; the
  engine casts before its sampler), so scores are float32 as stock's.

The generic path (HF's own modules, paged attention) gets the same treatment for the same
reason. What stays different is what differs in fp32 too, now at bf16's resolution: stock's
padded batch against the engine's packed one (which kernel blocking, which accumulation order),
so a score can move by a bf16 rounding step and a near tie can flip a greedy token. Stock itself
is batch-variant under bf16 autocast in the same way (the same prompt alone or in a left-padded
batch gives other tokens now and then), which bounds what "equal to stock" means here:
docs/rl.md has the measured rates.

Served: bf16 autocast on the model itself (not around a submodule), over float32 weights, on the
CPU, for attention-only text decoders (native or generic path). Refused by name (``autocast``),
with what to change: fp16 autocast, weights of another dtype, an autocast for another device
than the model's; CUDA, whose fused Triton kernels (norm, rope with the KV write, paged
attention) do not follow autocast's casts; recurrent layers (the engine's own mixers and float32
state pools), vision-language models (the image tower runs outside the decoder's forward) and
PEFT adapters on the wrapped model (merged or in LoRA slots, not PEFT's own matmuls). TRL's
LoRA runs are served all the same: accelerate wraps the ``PeftModel``'s forward there, which
PEFT's ``generate`` never calls, so stock's rollouts run in float32 and so do the engine's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.models import peft
from hf_paged.refusal import Refusal


@dataclass(frozen=True)
class AutocastState:
    """The arguments of one ``torch.autocast`` (picklable: it crosses to worker ranks)."""

    device_type: str  # "cpu" or "cuda"
    dtype: torch.dtype  # the lower-precision dtype (torch.bfloat16 when served)
    enabled: bool = True
    cache_enabled: bool = True  # autocast's cache of cast weights: values are the same either way

    @classmethod
    def of(cls, autocast) -> AutocastState:
        """The state of a ``torch.autocast`` object (as found in its decorator's closure)."""
        cache = getattr(autocast, "_cache_enabled", None)
        return cls(
            device_type=str(getattr(autocast, "device", "cpu")),
            dtype=getattr(autocast, "fast_dtype", torch.bfloat16),
            enabled=bool(getattr(autocast, "_enabled", True)),
            cache_enabled=True if cache is None else bool(cache),
        )

    def context(self) -> torch.autocast:
        return torch.autocast(
            self.device_type, dtype=self.dtype, enabled=self.enabled,
            cache_enabled=self.cache_enabled,
        )  # fmt: skip

    def describe(self) -> str:
        return f"torch.autocast({self.device_type!r}, dtype={self.dtype})"


def under(state: AutocastState | None):
    """A context running the engine's forward as the model's forward runs: under ``state``, or
    as is (None)."""
    return contextlib.nullcontext() if state is None else state.context()


def _weights(model: nn.Module) -> tuple[torch.dtype | None, torch.device | None]:
    p = next((p for p in model.parameters() if p.is_floating_point()), None)
    return (None, None) if p is None else (p.dtype, p.device)


def _unserved_part(model: nn.Module) -> str | None:
    """What of ``model`` the engine would compute otherwise than stock under autocast: recurrent
    layers (the engine's own mixers and their float32 state pools), an image tower (the front end
    runs it outside the forward), PEFT adapters (the engine merges them or runs them from its
    LoRA slots), or None."""
    from hf_paged.models.recurrent.registry import recurrent_modules

    config = getattr(model, "config", None)
    if getattr(config, "vision_config", None) is not None:
        return "a vision-language model (its image tower runs outside the decoder's forward)"
    found = recurrent_modules(model)
    if found:
        return f"recurrent layers ({type(found[0][1]).__name__})"
    if peft.tuner_modules(model):  # merged or in LoRA slots, not PEFT's own bf16 matmuls
        return "PEFT adapters on it"
    return None


def autocast_refusal(state: AutocastState, model: nn.Module, name: str = "") -> Refusal | None:
    """Why the engine does not reproduce ``model``'s forward under ``state`` (an enabled
    autocast around the forward of ``model``, or of its submodule ``name``), or None when it
    runs its own forward under the same (module docstring)."""
    dtype, device = _weights(model)
    where = f"the forward of {name!r}" if name else "the model's forward"
    what = f"{where} runs under {state.describe()} over {dtype} weights on {device}"
    off = (
        "turn mixed precision off (a trainer's bf16=False / fp16=False, accelerate's "
        "mixed_precision='no') for paged rollouts in the weights' dtype"
    )
    if name:
        why = "the engine runs a whole model under one precision, not one module apart"
    elif state.dtype != torch.bfloat16:
        why = "the engine serves bf16 autocast only (a trainer's bf16=True)"
        off += ", or use bf16 mixed precision instead"
    elif device is None or state.device_type != device.type:
        why = "the autocast is for another device than the model's"
    elif device.type != "cpu":
        why = (
            "on CUDA the engine's fused kernels (norm, rope, paged attention) do not follow "
            "autocast's casts; the engine serves bf16 autocast on the CPU"
        )
        off += ", or load the model in bfloat16 with mixed precision off for bf16 rollouts"
    elif dtype != torch.float32:
        why = "the engine serves bf16 autocast over float32 weights"
        off = (
            f"turn mixed precision off (the weights are {dtype} already: a trainer's "
            "bf16=False, accelerate's mixed_precision='no')"
        )
    elif (part := _unserved_part(model)) is not None:
        why = f"the engine serves bf16 autocast for attention-only text decoders, not {part}"
    else:
        return None
    return Refusal("autocast", f"{what}: {why}; {off}")


__all__ = ["AutocastState", "autocast_refusal", "under"]
