"""One engine per model, one caller at a time: the ``EngineOwner``.

Every front end reaches its engine through an owner: the ``generate`` dispatcher (one owner per
HF model object, hung off the model), ``PagedModelForCausalLM`` (an owner of the engine it was
opened with) and ``LLM`` (an owner of the engine it builds). The owner builds the engine on first
use and rebuilds it when the requested ``EngineConfig`` differs from the built one. Before every
call it asks the model's ``WeightWatch`` (``models/weight_watch.py``) what changed since the
engine read the weights: values changed in place (any optimizer, ``load_state_dict``, ``copy_``) are copied
again into the engine's own tensors (``LLMEngine.refresh_weights``: no rebuild, the KV cache
stays, the prefix cache is dropped); a replaced parameter or a new adapter state rebuilds it
(its shared tensors are the old storage), as does an engine that can't refresh, and so does a
new autocast around the model's forward (a trainer's mixed precision set after the engine was
built: the engine's runners run under the autocast they were built with). ``hold`` gives the
owner to one caller for the length of a ``with`` block: other threads wait, and the same thread
asking again gets the "reentrant" refusal (its requests are in the engine already).

Stock calls beside an engine (``give_back_for_stock``): an engine on a CUDA device took the
device's free memory (0.9 of it less what was in use at its start), so a stock ``generate`` on
the same model could run out of memory for its activations. Before every stock call that goes
through the ``generate`` dispatcher (``backend="hf"``, no switch, or a named fallback) and before
lm-eval's stock HFLM methods, the model's engine is closed when nobody holds it: its KV cache,
CUDA graphs, fused weights and the allocator's cached blocks go back, and the next paged call
builds it again with the same config. The stock call then has what it had before the engine
existed. Chosen over an engine that keeps room for stock: that room is unknown (beam search on
an 8B model needs GiBs of activations; a 0.6B model's forward little), while a rebuild costs a
warm engine start (~2-4 s), paid only when a caller alternates stock and paged calls on one
model (lm-eval issues one kind of request per call, and fallbacks are rare). An engine that a
caller holds (a nested stock call inside a paged one, another thread's paged call) is kept; CPU
engines are kept (their KV cache is a fixed byte count, not the device's free memory).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator

from hf_paged.config import EngineConfig
from hf_paged.integration.fallback import PagedFallback
from hf_paged.models import peft
from hf_paged.models.forward_wrappers import instance_autocast
from hf_paged.models.weight_watch import WeightWatch
from hf_paged.refusal import Refusal

_OWNER_ATTR = "_hf_paged_engine_owner"
_REENTRANT = Refusal("reentrant", "the model's engine is already held by this thread")
_lock = threading.Lock()
logger = logging.getLogger("hf_paged")


class EngineOwner:
    """A model's engine and the lock its callers take.

    Args:
        build: ``EngineConfig -> engine``; None for an owner of a fixed ``engine``.
        source: ``() -> model``, the in-memory model the engine is built from, whose weight
            changes the owner follows (None, or a call returning None: nothing to follow, e.g.
            the model is gone; the engine is kept).
        engine: an engine built already (it is never rebuilt).
    """

    def __init__(self, build: Callable | None = None, source: Callable | None = None,
                 engine=None):  # fmt: skip
        self._build = build
        self._source = source
        self.engine = engine
        self.built_with: EngineConfig | None = None if engine is None else engine.config
        self._watch: WeightWatch | None = None  # the model's weights as the engine read them
        self.configured: EngineConfig | None = None  # from ``configure``
        self.given_back: EngineConfig | None = None  # the config of an engine given back
        self.gave_back = 0  # engines closed for a stock call (``give_back_for_stock``)
        self.builds = 0  # engines built by ``get``
        self.refreshes = 0  # in-place weight refreshes by ``get``
        self._lock = threading.Lock()
        self._holder: int | None = None  # thread id inside ``hold``
        self._close_pending = False  # ``close_when_free`` asked while a caller held it

    # a deep copy or an unpickled copy of a model starts without an owner (``owner_of`` makes
    # one for it): an owner builds its engine for the model it was made for
    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (_no_owner, ())

    @property
    def follows_a_model(self) -> bool:
        """The engine is built from an in-memory model whose weight changes it follows."""
        return self._source is not None

    @property
    def held_here(self) -> bool:
        """This thread is inside ``hold``."""
        return self._holder == threading.get_ident()

    def get(self, config: EngineConfig | None = None):
        """The engine, built or rebuilt for ``config`` (else the configured one, else the one it
        has), its weights current. Call it while holding the owner (``hold``), or from a single
        thread."""
        want = config or self.configured or self.built_with or self.given_back or EngineConfig()
        if self._build is None:
            return self.engine
        model = self._source() if self._source is not None else None
        if self.engine is None:
            why = "first use"
        elif self.built_with != want:
            why = "engine config changed: " + _config_change(self.built_with, want)
        elif model is None or self._watch is None:
            return self.engine
        elif self._watch.layout_changed(model):
            why = "the model's parameters were replaced or its adapters changed"
        elif (autocast := _autocast_change(self.engine, model)) is not None:
            why = autocast
        else:
            why = self._refresh(model)
            if why is None:
                return self.engine
        self.close()
        start = time.perf_counter()
        logger.info("hf_paged: starting an engine (%s)", why)
        engine = self._build(want)
        if isinstance(engine, Refusal):  # the model cannot be served (``build``'s judgement)
            raise PagedFallback.of(engine)
        self.engine = engine
        self.builds += 1
        self.built_with = want
        lora = getattr(getattr(self.engine, "runtime", None), "lora", None)
        slots = lora is not None and lora.from_peft  # adapters read per call, not watched
        self._watch = WeightWatch(model, lora_slots=slots) if model is not None else None
        if logger.isEnabledFor(logging.INFO):
            rt = getattr(self.engine, "runtime", None)
            facts = ", ".join(
                f"{k}={getattr(rt, k)}" for k in ("max_model_len", "num_kv_blocks", "device")
                if hasattr(rt, k)
            )  # fmt: skip
            autocast = getattr(rt, "autocast", None)
            if autocast is not None:  # the model's mixed precision, which the engine runs under
                facts += f", under {autocast.describe()}"
            logger.info("hf_paged: engine ready in %.1f s (%s)", time.perf_counter() - start, facts)
        return self.engine

    def _refresh(self, model) -> str | None:
        """Copy changed weights into the engine in place; None when done (or nothing changed),
        else why the engine must be rebuilt instead."""
        names = self._watch.changed()
        if not names:
            return None
        refresh = getattr(self.engine, "refresh_weights", None)
        if refresh is None:
            return "the model's weights changed"
        start = time.perf_counter()
        try:
            copied = refresh(model, names)
        except (NotImplementedError, ValueError) as e:
            return f"the model's weights changed and the engine can't refresh them: {e}"
        self._watch.synced()
        self.refreshes += 1
        logger.info("hf_paged: %d changed weights refreshed in the engine (%d copied) in %.3f s",
                    len(names), copied, time.perf_counter() - start)  # fmt: skip
        return None

    @contextlib.contextmanager
    def hold(self) -> Iterator[EngineOwner]:
        """The owner for one caller's block (``get`` builds the engine inside it when needed);
        other threads' ``hold`` waits until the block ends.

        Raises:
            PagedFallback: this thread holds it already ("reentrant").
        """
        if self.held_here:
            raise PagedFallback.of(_REENTRANT)
        with self._lock:
            self._close_if_pending()
            self._holder = threading.get_ident()
            try:
                yield self
            finally:
                self._holder = None
                self._close_if_pending()

    def configure(self, config: EngineConfig) -> None:
        """The config later calls without one get; a built engine with another closes (unless a
        caller holds it: it closes at the next ``get``)."""
        self.configured = config
        if self.engine is not None and self.built_with != config and self._holder is None:
            self.close()

    def close(self) -> None:
        """Close the engine now (an owner with ``build`` builds a new one on the next ``get``)."""
        engine, self.engine, self.built_with, self._watch = self.engine, None, None, None
        self.given_back = None
        if engine is not None:
            engine.close()

    def close_when_free(self) -> None:
        """Close the engine now, or, while a caller holds it (another thread's call, or this
        thread's own callback inside a call), when that caller's block ends: closed under a
        running call, the engine would end it with a released KV cache."""
        if self._lock.acquire(blocking=False):
            try:
                self.close()
            finally:
                self._lock.release()
        else:  # the holder closes it on leaving (or the next ``hold``, if it left meanwhile)
            self._close_pending = True

    def _close_if_pending(self) -> None:
        if self._close_pending:
            self._close_pending = False
            self.close()

    def give_back_for_stock(self) -> bool:
        """Close the engine before a stock call on the model (module docstring), keeping its
        config for the next ``get``. Kept: no engine, a fixed engine (no ``build``), one that
        ``gives_back_for_stock`` says keeps no device memory, one a caller holds.

        Returns:
            True when the engine was closed.
        """
        engine = self.engine
        if engine is None or self._build is None or not gives_back_for_stock(engine):
            return False
        if not self._lock.acquire(blocking=False):  # held: in use by a caller (maybe this one)
            return False
        try:
            if self.engine is not engine:
                return False
            config = self.built_with
            self.close()
            self.given_back = config
            self.gave_back += 1
        finally:
            self._lock.release()
        logger.info("hf_paged: closed the model's engine to give its GPU memory to a stock call; "
                    "the next paged call starts it again")  # fmt: skip
        return True


def gives_back_for_stock(engine) -> bool:
    """Whether ``engine`` is closed before a stock call on its model: one on a CUDA device.
    Tests replace it to run the mechanism on CPU."""
    runtime = getattr(engine, "runtime", None)
    return str(getattr(runtime, "device", "cpu")).startswith("cuda")


def give_back_for_stock(model) -> bool:
    """Before a stock call on ``model``: close its engine (``EngineOwner.give_back_for_stock``).
    Nothing happens for a model that never had one. Returns True when one was closed."""
    owner = existing_owner(model)
    return owner is not None and owner.give_back_for_stock()


def _autocast_change(engine, model) -> str | None:
    """What changed in the autocast around ``model``'s forward since ``engine`` was built (the
    engine runs its forward under the one it was built with: ``models/autocast.py``), or None."""
    runtime = getattr(engine, "runtime", None)
    if runtime is None:
        return None
    built, now = getattr(runtime, "autocast", None), instance_autocast(model)
    if built == now:
        return None
    name = lambda s: "none" if s is None else s.describe()  # noqa: E731
    return f"the model's mixed precision changed: {name(built)} -> {name(now)}"


def _config_change(old: EngineConfig, new: EngineConfig) -> str:
    """``"max_model_len None -> 4097, ..."`` for the fields that differ."""
    changed = [
        f"{f.name} {getattr(old, f.name)!r} -> {getattr(new, f.name)!r}"
        for f in dataclasses.fields(new)
        if getattr(old, f.name) != getattr(new, f.name)
    ]
    return ", ".join(changed)


def owner_of(model, build: Callable) -> EngineOwner:
    """The owner hung off an HF model (a ``PeftModel``: the model inside it), made on first use.

    ``build(model, config)`` makes its engine. The owner keeps only a weak reference to the
    model, and the model's collection closes the engine.
    """
    model = peft.unwrap(model)
    owner = model.__dict__.get(_OWNER_ATTR)
    if owner is not None:
        return owner
    with _lock:
        owner = model.__dict__.get(_OWNER_ATTR)
        if owner is None:
            ref = weakref.ref(model)
            owner = EngineOwner(lambda cfg: build(ref(), cfg), ref)
            model.__dict__[_OWNER_ATTR] = owner  # a plain attribute, not a submodule
            # the engine may hold the model: a strong reference here would keep both for ever
            weakref.finalize(model, _close_owner, weakref.ref(owner))
    return owner


def existing_owner(model) -> EngineOwner | None:
    """The model's owner if one was made (nothing is built)."""
    return peft.unwrap(model).__dict__.get(_OWNER_ATTR)


def _no_owner() -> None:
    return None


def _close_owner(owner_ref) -> None:
    owner = owner_ref()
    if owner is not None:  # gone already when collected in a cycle: the engine closes itself
        owner.close()
