"""The cache a paged ``generate`` call returns and the cache it takes: stock's ``Cache`` object,
filled from the engine's KV blocks.

Stock ``generate`` returns its cache (the output's ``cache``, ``past_key_values`` in older
transformers) with ``return_dict_in_generate`` and ``use_cache``, and fills a cache passed in, in
place (the chat pattern: one ``DynamicCache`` given to every turn). Here:

* The object is stock's by construction: ``model._prepare_cache_for_generation`` builds the
  empty cache stock would build (a ``DynamicCache`` with the config's sliding layers, a
  ``StaticCache`` for ``cache_implementation="static"``), or it is the caller's own cache, reset.
  It is filled through its own ``update`` per layer, so each layer class keeps what it keeps (a
  sliding layer its last ``window - 1`` tokens, a static layer its preallocated length).
* The content is stock's: every row's tokens but the last (``sequences[:, :-1]``; beam search:
  the running beams), in the call's padded layout. Once the call has run, each row's tokens go
  to the engine again as an external-sampling request: the prefix cache finds the blocks the
  call wrote (only the last partial block is computed again), the engine pauses each request
  holding its blocks, ``engine.request_kv`` gathers them (one index per layer), and the requests
  end. Rows are placed at their attended positions; padding slots hold zeros (masked, never
  read: stock's hold what its forward computed for pad tokens).
* A cache passed in is stock's contract: it holds this model's KV of ``input_ids``' first
  tokens, and ``input_ids`` is the whole sequence. The engine runs the whole sequence (the
  prefix cache holds the earlier turn's blocks), so tokens and scores are a fresh call's, which
  are stock's. Before any request of the call is queued the passed content is compared with the
  engine's KV of the same tokens; a cache of other tokens or of another model runs stock.
* Compilation: the engine runs its own decode (CUDA graphs on GPU). Stock's compiled forward is
  set up as stock sets it up (``get_compiled_call`` when ``_valid_auto_compile_criteria``
  holds), so a caller or a later stock call that looks for it finds it.

Falls back by name (``_call_refusal``, ``_engine_refusal``): recurrent layers (stock's cache
holds their conv and recurrent states), tensor parallelism (the KV heads live in several
processes), an FP8 KV cache, KV layers that are not stock's cache layers one to one, quantized
and offloaded caches, and a passed cache that is a legacy tuple, of another class, batch or
length, or comes with prompt embeddings.
"""

from __future__ import annotations

import dataclasses

from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer

from hf_paged.integration.contract.states import (
    layer_kinds,
    recurrent_refusal,
)
from hf_paged.integration.prepare import CACHE_KWARGS, PreparedCall
from hf_paged.refusal import Refusal

# the layers of a passed DynamicCache the engine's KV (and state slots) fill as stock fills them
_SERVED_LAYERS = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer)
_SERVED_IMPLEMENTATIONS = (None, "dynamic", "static", "sliding_window", "hybrid", "hybrid_chunked")


def take_passed_cache(generate_kwargs: dict):
    """Remove the cache argument (any of its names) from ``generate_kwargs``; returns it or
    None."""
    found = [generate_kwargs.pop(k) for k in CACHE_KWARGS if k in generate_kwargs]
    found = [c for c in found if c is not None]
    return found[0] if found else None


def output_field() -> str:
    """The name of the cache field of stock's output dataclasses in this transformers."""
    from transformers.generation import GenerateDecoderOnlyOutput

    fields = {f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput)}
    return "cache" if "cache" in fields else "past_key_values"


@dataclasses.dataclass
class CacheContract:
    """What one call owes about caches, decided before its requests are queued."""

    cache: object | None  # stock's cache object to fill (the caller's, when passed), or None
    passed: bool  # the caller's cache: filled in place even without return_dict_in_generate
    fill: bool  # the call must fill ``cache`` (it is returned or was passed)
    # per stock cache layer: ("kv", engine KV layer) or ("state", recurrent layer) when filled
    kinds: list = dataclasses.field(default_factory=list)


def cache_contract(model, call: PreparedCall, passed, engine_of) -> CacheContract | Refusal:
    """The call's cache duties: stock's empty cache built as stock builds it, whether it must be
    filled, and stock's compiled forward set up as stock does.

    Args:
        engine_of: returns the engine (only asked when the cache must be filled).

    Returns:
        The contract, or the ``Refusal`` of cache duties only stock serves (``generate_paged``
        raises it): the reasons of ``_call_refusal`` and ``_engine_refusal``.
    """
    gen = call.generation_config
    use_cache = gen.use_cache is not False
    wants = bool(gen.return_dict_in_generate) and use_cache
    default_ok = getattr(type(model), "_supports_default_dynamic_cache", lambda: True)()
    if wants and not default_ok:  # stock's cache comes from the model's own forward
        return Refusal(
            "returned_cache", f"{type(model).__name__} builds a cache of its own in its forward"
        )
    refusal = _call_refusal(model, call, passed, wants)
    if refusal is not None:
        return refusal
    if passed is not None:
        cache = passed
    elif use_cache and default_ok:
        cache = _stock_cache(model, call)
        if isinstance(cache, Refusal):
            return cache
    else:
        cache = None
    if cache is not None:
        _set_up_compiled_forward(model, gen, cache)
    fill = cache is not None and (passed is not None or wants)
    kinds = []
    if fill:
        refusal = _engine_refusal(model, engine_of())
        if refusal is not None:
            return refusal
        kinds = layer_kinds(model, model.config.get_text_config(decoder=True).num_hidden_layers)
    return CacheContract(cache, passed is not None, fill, kinds)


def _call_refusal(model, call: PreparedCall, passed, wants: bool) -> Refusal | None:
    """(reason, message) when the call's cache duties need stock, judged without the engine."""
    gen = call.generation_config
    if passed is None and not wants:
        return None
    refusal = recurrent_refusal(model, passed is not None)
    if refusal is not None:
        return refusal
    if passed is not None:
        if call.prompt_embeds is not None:
            return Refusal("past_key_values", "a cache was passed with inputs_embeds or images")
        if isinstance(passed, (tuple, list)):
            return Refusal("past_key_values", "a legacy tuple cache was passed in (stock decides)")
        name = type(passed).__name__
        if (
            type(passed) is not DynamicCache
            or passed.offloading
            or not all(type(layer) in _SERVED_LAYERS for layer in passed.layers)
        ):
            return Refusal("past_key_values", f"a {name} with its own layers was passed in")
        if gen.cache_implementation is not None:
            return Refusal("past_key_values", "a cache and cache_implementation were both passed")
        if gen.use_cache is False:
            return Refusal("past_key_values", "a cache was passed with use_cache=False")
        length, rows = passed.get_seq_length(), call.input_ids.shape[0]
        if length and _batch_of(passed) != rows:
            return Refusal(
                "past_key_values", f"the cache passed in holds another batch than {rows} rows"
            )
        if length >= call.input_ids.shape[1]:
            return Refusal("past_key_values", "the cache passed in covers all of input_ids")
    if gen.cache_implementation not in _SERVED_IMPLEMENTATIONS and wants:
        return Refusal(
            "cache_implementation",
            f"cache_implementation={gen.cache_implementation!r} stores its cache in a form "
            "(quantized or offloaded) the engine's KV blocks are not copied into",
        )
    return None


def _batch_of(cache) -> int | None:
    """The rows a filled cache holds (its first attention or recurrent layer's)."""
    for layer in cache.layers:
        held = getattr(layer, "keys", None)
        if held is None and getattr(layer, "conv_states", None):
            held = layer.conv_states[0]
        if held is not None and held.dim() > 1:
            return held.shape[0]
    return None


def _engine_refusal(model, engine) -> Refusal | None:
    """(reason, message) when the engine's KV cannot become stock's cache layers."""
    config = engine.runtime.config
    if not hasattr(engine, "request_kv"):
        return Refusal("returned_cache", f"{type(engine).__name__} cannot read its KV blocks back")
    if config.tensor_parallel_size != 1:
        return Refusal(
            "returned_cache_tp", "the KV heads of a tensor-parallel engine live in its workers"
        )
    if getattr(config, "kv_cache_dtype", "auto") != "auto":
        return Refusal("returned_cache_fp8", f"the engine stores KV as {config.kv_cache_dtype}")
    specs = _kv_specs(engine)
    text = model.config.get_text_config(decoder=True)
    layers = getattr(text, "num_hidden_layers", None)
    kv_layers = sum(kind == "kv" for kind, _ in layer_kinds(model, layers or 0))
    if specs is not None and len(specs) != kv_layers:
        return Refusal(
            "returned_cache_layers",
            f"the engine has {len(specs)} KV layers for stock's {kv_layers} attention layers",
        )
    return None


def _kv_specs(engine):
    runner = getattr(getattr(engine, "executor", None), "runner", None)
    return getattr(runner, "kv_specs", None)


def _stock_cache(model, call: PreparedCall):
    """The empty cache stock's ``generate`` builds for this call (its side effects included:
    ``_previous_max_cache_length`` for static caches)."""
    gen = call.generation_config
    rows = call.input_ids.shape[0]
    per_input = max(gen.num_beams, gen.num_return_sequences)
    model_kwargs: dict = {}
    try:
        model._prepare_cache_for_generation(
            gen, model_kwargs, None, rows // per_input, gen.max_length - 1
        )
    except Exception as e:  # stock raises the same when it builds it: let it
        return Refusal("cache_implementation", f"stock's cache cannot be built: {e}")
    return model_kwargs.get("cache")


def _set_up_compiled_forward(model, gen, cache) -> None:
    """``model.get_compiled_call`` where stock's decoding would call it (it only wraps
    ``__call__`` in ``torch.compile``; nothing compiles until it is called)."""
    check = getattr(model, "_valid_auto_compile_criteria", None)
    if check is not None and str(getattr(model, "device", "meta")) != "meta":
        if check({"cache": cache}, gen):
            model.get_compiled_call(gen.compile_config)


__all__ = ["CACHE_KWARGS", "CacheContract", "cache_contract", "output_field", "take_passed_cache"]
