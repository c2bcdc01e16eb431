"""The ``generate`` dispatcher: stock behaviour unless a call or the process asks for "paged".

``install()`` replaces ``GenerationMixin.generate`` with a wrapper; ``uninstall()`` puts the
original function object back (``import hf_paged`` arranges ``install()`` for when transformers'
generation module is imported: see ``hooks.py``). The wrapper pops two keywords of its own,
``backend`` and ``paged_config`` (stock ``generate`` takes neither), and:

* with no switch (no ``backend=`` keyword, no ``set_default_backend("paged")``, no
  ``HF_PAGED_BACKEND=paged`` in the environment) calls the original with the other arguments
  untouched and builds no engine;
* with ``backend="paged"`` runs the call on the model's engine (``paged_call.generate_paged``),
  or, when the call needs something the engine can't reproduce, calls the original and warns once
  per reason per process with ``PagedFallbackWarning``.

One engine per model object (``engine_owner.owner_of``), built on first use, reused across calls,
rebuilt when the call's engine config differs, a parameter was replaced or the PEFT adapters
changed; weights changed in place (any optimizer, ``load_state_dict``, ``copy_``) are copied into
the engine before the next call without a rebuild (``models/weight_watch.py`` says how change is
seen).

Every stock call made here (``backend="hf"``, no switch, a named fallback) first gives the model's
CUDA engine back (``engine_owner.give_back_for_stock``: its KV cache and graphs are freed, the
next paged call starts it again), so stock has the memory it had before the engine existed. A
plain forward (``model(...)``) does not pass through here: call ``release(model)`` before a large
one.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading

from transformers.generation.utils import GenerationMixin

from hf_paged import envs
from hf_paged.config import EngineConfig
from hf_paged.integration import engine_owner, hooks, paged_call, servable
from hf_paged.integration.fallback import PagedFallback, call_stock, in_stock, warn_fallback
from hf_paged.refusal import Refusal
from hf_paged.timing import spans

ENV_VAR = "HF_PAGED_BACKEND"
BACKENDS = ("paged", "hf")  # "hf" = stock transformers generate
# keywords the dispatcher checks (servable.generate_refusal) or stock alone reads: never forwarded
NOT_FORWARDED = (
    "custom_generate", "synced_gpus", "negative_prompt_ids", "negative_prompt_attention_mask",
    "trust_remote_code",
)  # fmt: skip

_original_generate = None  # GenerationMixin.generate as found by install()
_default_backend: str | None = None  # set_default_backend; None = the environment decides
_lock = threading.Lock()


def _default_engine_factory(model, config: EngineConfig):
    """The model's engine, or the ``Refusal`` of a model the generic path's profile pass
    refused (``EngineOwner.get`` raises it)."""
    from hf_paged.engine.llm_engine import LLMEngine
    from hf_paged.models.protocol import UnsupportedModelError

    try:
        return LLMEngine(model, config)
    except UnsupportedModelError as e:
        return Refusal("architecture", f"{type(model).__name__}: {e}")


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
    check_backend("backend", backend, allow_none=True)
    _default_backend = backend


def get_default_backend() -> str:
    """The backend a call without ``backend=`` gets now."""
    if _default_backend is not None:
        return _default_backend
    return envs.get(ENV_VAR)  # validated there: "hf" (unset) or "paged"


def check_backend(name: str, value, allow_none: bool = False) -> None:
    if (value is None and allow_none) or value in BACKENDS:
        return
    raise ValueError(f"{name}={value!r} is not allowed: must be one of {list(BACKENDS)}")


def as_engine_config(value, name: str = "paged_config") -> EngineConfig:
    if isinstance(value, EngineConfig):
        return value
    if isinstance(value, dict):
        return EngineConfig.from_dict(value)
    raise TypeError(f"{name}={value!r} is not allowed: must be an EngineConfig or a dict")


# ---- engines -----------------------------------------------------------------------------


def _build(model, config: EngineConfig):
    return engine_factory(model, config)  # looked up at each build: tests replace it


def owner(model) -> engine_owner.EngineOwner:
    """``model``'s engine owner (a ``PeftModel``: the HF model inside it, where its calls land)."""
    return engine_owner.owner_of(model, _build)


def configure(model, **engine_kwargs) -> EngineConfig:
    """Engine options for ``model``'s paged calls that pass no ``paged_config``.

    A different config than the built engine's closes it; the next paged call rebuilds.

    Raises:
        TypeError: an unknown key. ValueError: a bad value (both name the key).
    """
    config = EngineConfig.from_dict(engine_kwargs)
    owner(model).configure(config)
    return config


def get_engine(model, paged_config: EngineConfig | dict | None = None):
    """``model``'s engine, built (or rebuilt) to ``paged_config`` / ``configure`` / defaults.

    Without either, an existing engine is reused whatever its config.
    """
    config = None if paged_config is None else as_engine_config(paged_config)
    return owner(model).get(config)


@contextlib.contextmanager
def hold_engine(model, paged_config: EngineConfig | dict | None = None):
    """``model``'s engine held for one caller (a ``with`` block): other threads' paged calls on
    ``model`` wait, and a paged ``generate`` on ``model`` from this thread runs stock.

    Raises:
        PagedFallback: this thread already holds the engine, or the model paths refuse it.
    """
    config = None if paged_config is None else as_engine_config(paged_config)
    with owner(model).hold() as held:
        yield held.get(config)


def release(model) -> None:
    """Close ``model``'s engine now (the next paged call builds a new one); during a paged call
    on ``model`` (another thread's, or from a streamer or criterion inside it), once it ends."""
    found = engine_owner.existing_owner(model)
    if found is not None:
        found.close_when_free()


# ---- the wrapper -------------------------------------------------------------------------


def _make_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        backend = kwargs.pop("backend", None)
        paged_config = kwargs.pop("paged_config", None)
        check_backend("backend", backend, allow_none=True)
        if paged_config is not None:
            paged_config = as_engine_config(paged_config)  # bad input raises on any path
        if backend is None:
            backend = "hf" if in_stock() else get_default_backend()
        with spans.span("client.requests"):  # a generate call is a request phase of its own
            if backend != "paged":
                engine_owner.give_back_for_stock(self)
                with spans.span("model.stock"):
                    return call_stock(original, self, args, kwargs)
            return _generate_paged(original, signature, self, args, kwargs, paged_config)

    generate.__hf_paged_original__ = original
    return generate


def _generate_paged(original, signature, model, args, kwargs, paged_config):
    bound = signature.bind(model, *args, **kwargs)
    named = {k: v for k, v in bound.arguments.items() if k not in ("self", "kwargs")}
    extra = dict(bound.arguments.get("kwargs", {}))
    fb = servable.generate_refusal(model, named, extra)
    if fb is None:
        forwarded = {k: v for k, v in {**named, **extra}.items() if k not in NOT_FORWARDED}
        try:
            with engine_owner.owner_of(model, _build).hold() as held:
                return paged_call.generate_paged(
                    model, lambda: held.get(paged_config), hold_engine, **forwarded
                )
        except PagedFallback as e:
            fb = e.refusal
    engine_owner.give_back_for_stock(model)  # kept when held (a nested call: "reentrant")
    return call_stock(original, model, args, kwargs, fb)


hooks.module_ready(__name__)  # an install hooks deferred while this module executed

__all__ = [
    "configure", "get_default_backend", "get_engine", "hold_engine", "install", "is_installed",
    "release", "set_default_backend", "uninstall", "warn_fallback",
]  # fmt: skip
