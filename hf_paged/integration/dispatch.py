"""The ``generate`` dispatcher: stock behaviour unless a call or the process asks for "paged".

``install()`` (run by ``import hf_paged``) replaces ``GenerationMixin.generate`` with a wrapper;
``uninstall()`` puts the original function object back. The wrapper pops two keywords of its own,
``backend`` and ``paged_config`` (transformers 5.24's ``generate`` takes neither), and:

* with no switch (no ``backend=`` keyword, no ``set_default_backend("paged")``, no
  ``HF_PAGED_BACKEND=paged`` in the environment) calls the original with the other arguments
  untouched and builds no engine;
* with ``backend="paged"`` runs the call on the model's engine (``generate.generate_paged``), or,
  when the call needs something the engine can't reproduce, calls the original and warns once per
  reason per process with ``PagedFallbackWarning``.

One engine per model object, built on first use, reused across calls, rebuilt when the call's
engine config differs or the model's parameters were replaced or changed in place since it was
built (the engine shares their storage but holds fused copies of some), or its PEFT adapters
changed (another active adapter, ``disable_adapter()``, merged, rescaled): the engine serves LoRA
merged into its own weights (``peft.py``). Writes through ``param.data`` bump no version counter
and are not seen: call ``release(model)`` after them. It hangs off the model in a
private attribute (a copy of the model starts without one) and is closed with the model.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
import warnings
import weakref

import torch
from transformers.generation.utils import GenerationMixin

from hf_paged import envs
from hf_paged.config import EngineConfig
from hf_paged.integration.generate import PagedFallback, generate_paged
from hf_paged.models import peft

ENV_VAR = "HF_PAGED_BACKEND"
BACKENDS = ("paged", "hf")  # "hf" = stock transformers generate
_SLOT_ATTR = "_hf_paged_engine_slot"
_CACHE_KWARGS = ("past_key_values", "cache", "cache_params")
_NOT_FORWARDED = (
    "custom_generate",
    "synced_gpus",
    "negative_prompt_ids",
    "negative_prompt_attention_mask",
    "trust_remote_code",
)


class PagedFallbackWarning(UserWarning):
    """``generate(backend="paged")`` ran stock ``generate`` for the reason in the message."""


_original_generate = None  # GenerationMixin.generate as found by install()
_default_backend: str | None = None  # set_default_backend; None = the environment decides
_in_stock = contextvars.ContextVar("hf_paged_in_stock", default=False)
_warned: set[str] = set()
_lock = threading.Lock()


def _default_engine_factory(model, config: EngineConfig):
    from hf_paged.engine.llm_engine import LLMEngine

    return LLMEngine(model, config)


# builds a model's engine: (model, EngineConfig) -> engine. Tests replace it.
engine_factory = _default_engine_factory


# ---- install / switches ----------------------------------------------------------------------


def install() -> None:
    """Put the dispatcher on ``GenerationMixin.generate``. Idempotent."""
    global _original_generate
    with _lock:
        current = GenerationMixin.__dict__["generate"]
        if getattr(current, "__hf_paged_original__", None) is not None:
            return
        _original_generate = current
        GenerationMixin.generate = _make_wrapper(current)


def uninstall() -> None:
    """Restore the original ``GenerationMixin.generate`` (the same function object)."""
    with _lock:
        current = GenerationMixin.__dict__["generate"]
        original = getattr(current, "__hf_paged_original__", None)
        if original is not None:
            GenerationMixin.generate = original


def is_installed() -> bool:
    return getattr(GenerationMixin.__dict__["generate"], "__hf_paged_original__", None) is not None


def set_default_backend(backend: str | None) -> None:
    """Backend for calls without a ``backend=`` keyword: "paged", "hf" (stock), or None to let
    ``HF_PAGED_BACKEND`` decide (unset = stock; read once per process, see ``hf_paged.envs``).

    Raises:
        ValueError: any other value.
    """
    global _default_backend
    _check_backend("backend", backend, allow_none=True)
    _default_backend = backend


def get_default_backend() -> str:
    """The backend a call without ``backend=`` gets now."""
    if _default_backend is not None:
        return _default_backend
    return envs.get(ENV_VAR)  # validated there: "hf" (unset) or "paged"


def _check_backend(name: str, value, allow_none: bool = False) -> None:
    if (value is None and allow_none) or value in BACKENDS:
        return
    raise ValueError(f"{name}={value!r} is not allowed: must be one of {list(BACKENDS)}")


# ---- engines -----------------------------------------------------------------------------


class _EngineSlot:
    """A model's engine and the config it should have. Copies of a model start empty."""

    def __init__(self):
        self.engine = None
        self.built_with: EngineConfig | None = None  # the engine's config
        self.fingerprint: tuple | None = None  # the model's parameters when it was built
        self.configured: EngineConfig | None = None  # from configure()
        self.lock = threading.Lock()  # one generate call at a time per engine
        self.owner: int | None = None  # thread id holding ``lock``
        self.finalizer = None

    def __deepcopy__(self, memo):
        return _EngineSlot()

    def __reduce__(self):
        return (_EngineSlot, ())

    def close(self) -> None:
        engine, self.engine, self.built_with, self.fingerprint = self.engine, None, None, None
        if engine is not None:
            engine.close()


def _close_slot(slot_ref) -> None:
    slot = slot_ref()
    if slot is not None:  # gone already when collected in a cycle: the engine closes itself
        slot.close()


def _slot(model) -> _EngineSlot:
    slot = model.__dict__.get(_SLOT_ATTR)
    if slot is None or slot.finalizer is None:
        with _lock:
            slot = model.__dict__.get(_SLOT_ATTR)
            if slot is None:
                slot = _EngineSlot()
                model.__dict__[_SLOT_ATTR] = slot  # plain attribute, not a submodule
            if slot.finalizer is None:
                # only a weak reference: the engine may hold the model, so a strong one here
                # would keep both alive for ever
                slot.finalizer = weakref.finalize(model, _close_slot, weakref.ref(slot))
    return slot


def _as_engine_config(value, name: str = "paged_config") -> EngineConfig:
    if isinstance(value, EngineConfig):
        return value
    if isinstance(value, dict):
        return EngineConfig.from_dict(value)
    raise TypeError(f"{name}={value!r} is not allowed: must be an EngineConfig or a dict")


def _fingerprint(model) -> tuple:
    """The model's parameters (storage, in-place version, layout) and its PEFT adapter state
    (active adapter, enabled, merged, scaling): a change in either rebuilds the engine."""
    params = tuple(
        (p.data_ptr(), p._version, p.dtype, p.device, tuple(p.shape)) for p in model.parameters()
    )
    return params, peft.adapter_state(model)


def configure(model, **engine_kwargs) -> EngineConfig:
    """Engine options for ``model``'s paged calls that pass no ``paged_config``.

    A different config than the built engine's closes it; the next paged call rebuilds.

    Raises:
        TypeError: an unknown key. ValueError: a bad value (both name the key).
    """
    config = EngineConfig.from_dict(engine_kwargs)
    slot = _slot(peft.unwrap(model))  # a PeftModel's calls reach the HF model inside it
    slot.configured = config
    if slot.engine is not None and slot.built_with != config and slot.owner is None:
        slot.close()
    return config


def get_engine(model, paged_config: EngineConfig | dict | None = None):
    """``model``'s engine, built (or rebuilt) to ``paged_config`` / ``configure`` / defaults.

    Without either, an existing engine is reused whatever its config. A ``PeftModel``'s engine
    is the one of the HF model inside it (where its ``generate`` calls arrive).
    """
    model = peft.unwrap(model)
    slot = _slot(model)
    if paged_config is not None:
        want = _as_engine_config(paged_config)
    elif slot.configured is not None:
        want = slot.configured
    else:
        want = slot.built_with or EngineConfig()
    if slot.engine is not None and (
        slot.built_with != want or slot.fingerprint != _fingerprint(model)
    ):
        slot.close()
    if slot.engine is None:
        slot.engine = engine_factory(model, want)
        slot.built_with = want
        slot.fingerprint = _fingerprint(model)
    return slot.engine


def _build_engine(model, paged_config):
    """``get_engine``; a model the engine's model paths refuse at build time (the generic
    path's profile pass) becomes a fallback with the refusal as its reason."""
    from hf_paged.models.generic.support import UnsupportedModelError

    try:
        return get_engine(model, paged_config)
    except UnsupportedModelError as e:
        raise PagedFallback("architecture", f"{type(model).__name__}: {e}") from None


@contextlib.contextmanager
def hold_engine(model, paged_config: EngineConfig | dict | None = None):
    """``model``'s engine (as ``get_engine``) held for one caller: other threads' paged calls
    on ``model`` wait, and a paged ``generate`` on ``model`` from this thread runs stock (as a
    reentrant call does). For callers that keep requests in the engine across many steps.

    Raises:
        PagedFallback: this thread already holds the engine, or the model paths refuse it.
    """
    slot = _slot(model)
    if slot.owner == threading.get_ident():
        raise PagedFallback("reentrant", "the model's engine is already held by this thread")
    with slot.lock:
        slot.owner = threading.get_ident()
        try:
            yield _build_engine(model, paged_config)
        finally:
            slot.owner = None


@contextlib.contextmanager
def hold_draft_engine(assistant):
    """The engine of an assisted call's ``assistant_model``, held like ``hold_engine``: an HF
    model's own paged engine (its ``configure`` options apply), or a
    ``PagedModelForCausalLM``'s.

    Raises:
        PagedFallback: the engine cannot serve the assistant (the reason prefixed
            ``assistant_``).
    """
    if not isinstance(assistant, torch.nn.Module) and callable(
        getattr(assistant, "hold_engine", None)
    ):
        with assistant.hold_engine() as engine:  # a PagedModelForCausalLM
            yield engine
        return
    reason = _model_reason(assistant) if isinstance(assistant, torch.nn.Module) else (
        "model", f"{type(assistant).__name__} is not a model the engine can run"
    )  # fmt: skip
    if reason is not None:
        raise PagedFallback(f"assistant_{reason[0]}", f"the assistant: {reason[1]}")
    with hold_engine(assistant) as engine:
        yield engine


def release(model) -> None:
    """Close ``model``'s engine now (the next paged call builds a new one)."""
    slot = peft.unwrap(model).__dict__.get(_SLOT_ATTR)
    if slot is not None:
        slot.close()


# ---- fallbacks ---------------------------------------------------------------------------


def warn_fallback(reason: str, detail: str) -> None:
    """One ``PagedFallbackWarning`` per ``reason`` per process."""
    with _lock:
        if reason in _warned:
            return
        _warned.add(reason)
    warnings.warn(
        f"generate(backend='paged') ran stock transformers generate: {detail} [{reason}]",
        PagedFallbackWarning,
        stacklevel=4,
    )


def _reset_fallback_warnings() -> None:
    """Forget which reasons warned (tests)."""
    with _lock:
        _warned.clear()


def precheck(model, args: dict, kwargs: dict) -> tuple[str, str] | None:
    """``(reason, detail)`` when the call can't go paged, judged from the arguments and the
    model alone (what needs the prepared generation config is judged in ``prepare_call``)."""
    if args.get("custom_generate") is not None:
        return "custom_generate", "custom_generate replaces the decoding loop"
    if getattr(model.config, "is_encoder_decoder", False):
        return "encoder_decoder", "the model is an encoder-decoder"
    if kwargs.get("assistant_tokenizer") is not None:
        return "universal_assisted", "assistant_tokenizer= drafts with another tokenizer"
    if kwargs.get("assistant_early_exit") is not None:
        return "assistant_early_exit", "assistant_early_exit drafts with the model's own layers"
    if args.get("assistant_model") is not None and args["assistant_model"] is model:
        return "assisted_self", "assistant_model is the model itself"
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        return "past_key_values", "a cache was passed in"
    if args.get("synced_gpus"):
        return "synced_gpus", "synced_gpus=True"
    if args.get("negative_prompt_ids") is not None or (
        args.get("negative_prompt_attention_mask") is not None
    ):
        return "guidance_scale", "a negative prompt needs a second model pass"
    if kwargs.get("inputs_embeds") is not None:
        return "inputs_embeds", "inputs_embeds were passed"
    if kwargs.get("cache_implementation") == "paged":
        return "cache_implementation", "cache_implementation='paged' selects transformers' own"
    return _model_reason(model)


def _model_reason(model) -> tuple[str, str] | None:
    from hf_paged.engine.runtime import quantization_method
    from hf_paged.models.registry import model_class_reason

    method = quantization_method(model)
    if method is not None:
        return f"quantized_{method}", (
            f"the model is quantized (quant_method={method!r}); the engine runs only "
            "unquantized float weights"
        )
    reason = peft.unsupported_reason(model)
    if reason is not None:
        return reason
    model = peft.unwrap(model)  # a PeftModel: the HF model inside serves its calls
    why = model_class_reason(type(model), model.config)
    if why is not None:
        return "architecture", why
    adapter_only = peft.adapter_parameter_names(model) if peft.tuner_modules(model) else ()
    served = [p for n, p in model.named_parameters() if n not in adapter_only]
    devices = {p.device for p in served}
    dtypes = {p.dtype for p in served}
    device_map = getattr(model, "hf_device_map", None) or {}
    if len(devices) != 1 or len(set(device_map.values())) > 1:
        return "device", "the model is spread over several devices"
    (device,), dtype = devices, next(iter(dtypes))
    if device.type not in ("cpu", "cuda"):
        return "device", f"the model is on {device.type}"
    ok = (torch.float32, torch.bfloat16) if device.type == "cpu" else (
        torch.float32, torch.float16, torch.bfloat16,
    )  # fmt: skip
    if len(dtypes) != 1 or dtype not in ok:
        return "dtype", f"the engine does not run {sorted(map(str, dtypes))} on {device.type}"
    if model.training and _has_dropout(model):
        return "training_mode", "the model is in training mode with dropout"
    return None


def _has_dropout(model) -> bool:
    if (getattr(model.config, "attention_dropout", 0.0) or 0.0) > 0:
        return True
    return any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules())


# ---- the wrapper -------------------------------------------------------------------------


def _call_stock(original, model, args, kwargs):
    token = _in_stock.set(True)  # generate calls made inside stock generate stay stock
    try:
        return original(model, *args, **kwargs)
    finally:
        _in_stock.reset(token)


def _make_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        backend = kwargs.pop("backend", None)
        paged_config = kwargs.pop("paged_config", None)
        _check_backend("backend", backend, allow_none=True)
        if paged_config is not None:
            paged_config = _as_engine_config(paged_config)  # bad input raises on any path
        if backend is None:
            backend = "hf" if _in_stock.get() else get_default_backend()
        if backend != "paged":
            return _call_stock(original, self, args, kwargs)
        return _generate_paged(original, signature, self, args, kwargs, paged_config)

    generate.__hf_paged_original__ = original
    return generate


def _generate_paged(original, signature, model, args, kwargs, paged_config):
    bound = signature.bind(model, *args, **kwargs)
    named = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
    extra = dict(bound.arguments.get("kwargs", {}))
    reason = precheck(model, named, extra)
    if reason is not None:
        warn_fallback(*reason)
        return _call_stock(original, model, args, kwargs)
    slot = _slot(model)
    if slot.owner == threading.get_ident():
        warn_fallback("reentrant", "generate was called from inside a paged generate call")
        return _call_stock(original, model, args, kwargs)
    with slot.lock:
        slot.owner = threading.get_ident()
        try:
            for k in _NOT_FORWARDED:  # checked by precheck, or stock-only switches
                named.pop(k, None)
                extra.pop(k, None)
            return generate_paged(
                model, lambda: _build_engine(model, paged_config), hold_draft_engine,
                **named, **extra,
            )  # fmt: skip
        except PagedFallback as fb:
            warn_fallback(fb.reason, fb.detail)
        finally:
            slot.owner = None
    return _call_stock(original, model, args, kwargs)
