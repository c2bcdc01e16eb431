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
* ``torch.autocast`` as a decorator (accelerate's mixed precision, TRL's default ``bf16=True``).
  Disabled: followed. Enabled on the model itself, bf16 over float32 weights on the CPU:
  followed, and ``instance_autocast`` returns it as an ``AutocastState``: the engine runs its
  forward under the same autocast (``models/autocast.py`` says what that reproduces). Any other
  autocast (fp16, over weights of another dtype, on CUDA, around a submodule) is refused by name
  (``autocast``), saying what to change.

Anything else (an unknown wrapper, a bound method of another object) is ``patched_forward``.
"""

from __future__ import annotations

import types

from torch import nn

from hf_paged.models.autocast import AutocastState, autocast_refusal
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
    """``(inner forward, None)`` for a wrapper that leaves generation unchanged or that the
    engine reproduces (a served autocast, read by ``_walk``), ``(None, refusal)`` for one that
    changes it, ``(None, None)`` for the class's own forward."""
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
        refusal = autocast_refusal(AutocastState.of(autocast), model, name)
        return (None, refusal) if refusal is not None else (_cell(fn, "func"), None)
    if fn is getattr(type(model), "forward", None):
        return None, None  # the class's function (a wrapper's inner call passes self)
    return None, _patched(name, getattr(fn, "__qualname__", type(fn).__name__))


def _walk(model: nn.Module, name: str) -> tuple[Refusal | None, AutocastState | None]:
    """The forward set on ``model`` followed to the class's: why it changes what generation
    computes (or None), and the served autocast it passed through (or None)."""
    fn = vars(model).get("forward")
    autocast = None
    for _ in range(_MAX_DEPTH):
        if fn is None:
            return _patched(name, "an empty wrapper"), None
        inner, refusal = _unwrap_one(fn, model, name)
        if refusal is not None or inner is None:
            return refusal, (autocast if refusal is None else None)
        if _is(fn, "torch.amp.autocast_mode", "autocast_decorator.<locals>.decorate_autocast"):
            state = AutocastState.of(_cell(fn, "autocast_instance"))
            if state.enabled:
                if autocast is not None and autocast != state:  # two different autocasts
                    return _patched(name, "two nested autocasts"), None
                autocast = state
        fn = inner
    return _patched(name, f"more than {_MAX_DEPTH} wrappers"), None


def instance_forward_refusal(model: nn.Module, name: str = "") -> Refusal | None:
    """Why the forward set on ``model`` (``vars(model)["forward"]``) changes what generation
    computes, or None when it reduces to the class's forward or to one the engine reproduces
    (module docstring)."""
    return _walk(model, name)[0] if "forward" in vars(model) else None


def instance_autocast(model: nn.Module) -> AutocastState | None:
    """The autocast the forward set on ``model`` runs under, when the engine serves it (it then
    runs its own forward under the same); None for a forward without one, or one refused."""
    return _walk(model, "")[1] if "forward" in vars(model) else None


def _label(name: str) -> str:
    return repr(name) if name else "the model"


def _patched(name: str, what: str) -> Refusal:
    return Refusal(
        "patched_forward",
        f"{_label(name)} has its own forward set on the instance ({what}), which runs "
        "in stock's forward only (the wrappers served are TRL's add_fused_lm_head, "
        "accelerate's fp32 output cast and its bf16 autocast): restore the class's forward "
        "(del model.forward) to serve the model paged, or generate with backend='hf'",
    )
