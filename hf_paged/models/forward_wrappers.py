"""Forwards set on a model instance: which ones leave generation as the class's forward makes it.

The engine runs its own modules from the model's weights, so a forward that stock ``generate``
calls on the instance must compute what the class's forward computes, or the call runs stock.
Trainers wrap the forward for their loss and their precision; the wrappers read here are
followed down their chain, one layer at a time, to the class's forward:

* TRL's ``add_fused_lm_head`` (GRPO, RLOO, SFT): ``_fused_forward`` returns the original
  forward's result unless the call passes ``fused_lm_head=True``, which ``generate`` never does
  (its own docstring: "generation is unchanged"). Followed to its ``original_forward``.
* accelerate's ``convert_outputs_to_fp32`` (``ConvertOutputsToFp32``): casts half-precision
  outputs to float32, exactly; ``generate`` takes its logits in float32 anyway. Followed.
* ``torch.autocast`` as a decorator (accelerate's mixed precision, TRL's ``bf16=True``): the
  forward's matmuls run in bf16/fp16 over the weights' dtype, which the engine does not
  reproduce. Disabled: followed. Enabled: refused by name (``autocast``) with what to change.

Anything else (an unknown wrapper, a bound method of another object) is ``patched_forward``.
"""

from __future__ import annotations

import types

from torch import nn

from hf_paged.refusal import Refusal

_MAX_DEPTH = 8  # wrappers followed before giving up


def _closure(fn) -> dict:
    code = getattr(fn, "__code__", None)
    cells = getattr(fn, "__closure__", None) or ()
    return dict(zip(code.co_freevars, cells, strict=True)) if code is not None else {}


def _cell(fn, name: str):
    cell = _closure(fn).get(name)
    try:
        return cell.cell_contents if cell is not None else None
    except ValueError:  # an empty cell
        return None


def _is(fn, module: str, qualname: str) -> bool:
    code = getattr(fn, "__code__", None)
    return (
        code is not None
        and getattr(code, "co_qualname", code.co_name) == qualname
        and getattr(fn, "__globals__", {}).get("__name__") == module
    )


def _unwrap_one(fn, model: nn.Module, name: str):
    """``(inner forward, None)`` for a wrapper that leaves generation unchanged, ``(None,
    refusal)`` for one that changes it, ``(None, None)`` for the class's own forward."""
    if isinstance(fn, types.MethodType):
        if fn.__self__ is not model:
            return None, _patched(name, f"a method of a {type(fn.__self__).__name__}")
        if fn.__func__ is getattr(type(model), "forward", None):
            return None, None  # the class's forward, bound to the model
        return fn.__func__, None
    if _is(fn, "trl.trainer.utils", "add_fused_lm_head.<locals>._fused_forward"):
        return _cell(fn, "original_forward"), None
    if type(fn).__name__ == "ConvertOutputsToFp32" and type(fn).__module__.startswith(
        "accelerate."
    ):
        return fn.model_forward, None
    if _is(fn, "accelerate.utils.operations", "convert_outputs_to_fp32.<locals>.forward"):
        return getattr(fn, "__wrapped__", None), None
    if _is(fn, "torch.amp.autocast_mode", "autocast_decorator.<locals>.decorate_autocast"):
        autocast = _cell(fn, "autocast_instance")
        if autocast is not None and not getattr(autocast, "_enabled", True):
            return _cell(fn, "func"), None
        return None, _autocast(name, model, autocast)
    if fn is getattr(type(model), "forward", None):
        return None, None  # the class's function (a wrapper's inner call passes self)
    return None, _patched(name, getattr(fn, "__qualname__", type(fn).__name__))


def instance_forward_refusal(model: nn.Module, name: str = "") -> Refusal | None:
    """Why the forward set on ``model`` (``vars(model)["forward"]``) changes what generation
    computes, or None when it reduces to the class's forward (module docstring)."""
    fn = vars(model).get("forward")
    for _ in range(_MAX_DEPTH):
        if fn is None:
            return _patched(name, "an empty wrapper")
        inner, refusal = _unwrap_one(fn, model, name)
        if refusal is not None or inner is None:
            return refusal
        fn = inner
    return _patched(name, f"more than {_MAX_DEPTH} wrappers")


def _label(name: str) -> str:
    return repr(name) if name else "the model"


def _patched(name: str, what: str) -> Refusal:
    return Refusal(
        "patched_forward",
        f"{_label(name)} has its own forward set on the instance ({what}), which runs "
        "in stock's forward only (the wrappers served are TRL's add_fused_lm_head and "
        "accelerate's fp32 output cast): restore the class's forward (del model.forward) to "
        "serve the model paged, or generate with backend='hf'",
    )


def _autocast(name: str, model: nn.Module, autocast) -> Refusal:
    dtype = getattr(autocast, "fast_dtype", None)
    device = getattr(autocast, "device", "?")
    weights = next((str(p.dtype) for p in model.parameters()), "?")
    return Refusal(
        "autocast",
        f"the forward of {_label(name)} runs under torch.autocast({device!r}, dtype={dtype}) over "
        f"{weights} weights (accelerate's mixed precision, e.g. a trainer's bf16=True or "
        "fp16=True), and the engine computes in the weights' dtype: turn mixed precision off "
        "(bf16=False / mixed_precision='no') for paged rollouts in float32, or load the model in "
        "that dtype with mixed precision off to have them in it",
    )
