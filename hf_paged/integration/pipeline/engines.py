"""Which engine a pipeline batch runs on (``EngineTarget``): the HF model's (through the
dispatcher) or a ``PagedModelForCausalLM``'s; batches with the same key share one engine run.
(How a call runs on that engine, native, external or beams, is ``route``'s.)"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from hf_paged.config import EngineConfig
from hf_paged.integration import dispatch, servable

# keywords the dispatcher consumes (or stock alone reads) before preparing a paged call
NOT_FORWARDED = ("backend", "paged_config", *dispatch.NOT_FORWARDED)


@dataclass(frozen=True)
class EngineTarget:
    """The engine a batch runs on, and what its calls are prepared and judged against."""

    key: tuple  # batches with the same key share one engine run
    prep_model: object  # what stock's preparation runs on
    hold: Callable  # () -> context manager yielding the engine
    generate_refusal: Callable  # generate kwargs -> Refusal or None


def engine_key(model, kwargs: dict) -> tuple | None:
    """The key for a batch with these ``generate`` keywords; None: it runs per batch."""
    from hf_paged.integration.auto import PagedModelForCausalLM

    backend, paged_config = kwargs.get("backend"), kwargs.get("paged_config")
    if isinstance(model, PagedModelForCausalLM):
        # other switches: the per-batch path raises the model's own error for them
        return ("paged_model",) if backend in (None, "paged") and paged_config is None else None
    if backend is None:
        backend = dispatch.get_default_backend()
    if backend != "paged" or not dispatch.is_installed():
        return None
    if isinstance(paged_config, dict):
        paged_config = EngineConfig.from_dict(paged_config)
    return ("hf", paged_config)


def engine_target(model, kwargs: dict) -> EngineTarget | None:
    """How a batch with these ``generate`` keywords reaches the engine; None: it doesn't."""
    from hf_paged.integration.auto import PagedModelForCausalLM

    key = engine_key(model, kwargs)
    if key is None:
        return None
    if isinstance(model, PagedModelForCausalLM):
        skeleton = model.skeleton  # on the meta device by design: argument checks only
        return EngineTarget(
            key, skeleton, model.hold_engine,
            lambda kw: servable.generate_refusal(skeleton, kw, kw, model_checks=False),
        )  # fmt: skip
    # the model's own checks walk its parameters: once per engine (one pipeline call), not per
    # batch (at batch_size 1 they were a third of a 64-prompt call's time on the H200)
    model_refusal = functools.cache(lambda: servable.model_refusal(model))
    return EngineTarget(
        key, model, lambda: dispatch.hold_engine(model, key[1]),
        lambda kw: servable.generate_refusal(model, kw, kw, model_checks=False) or model_refusal(),
    )  # fmt: skip
