"""Which LoRA adapter each row of a routed call runs under: an in-memory PEFT model served from
the engine's LoRA slots (``models/adapters/peft_lora.py``) registers the call's adapters with its
engine and sets the rows' keys (``route`` asks, for every front end); lm-eval's own requests take
the model's active adapters (``active_lora_key``)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from hf_paged.models.adapters import peft_lora
from hf_paged.refusal import Refusal


def lora_refusal(model, engine: Callable[[], object], routed, adapter_names=None) -> Refusal | None:
    """Give each row of ``routed`` (``Native``, ``External`` or ``Beams``) the LoRA adapter
    PEFT's forward would apply to it; nothing for a model without adapters.

    Args:
        adapter_names: per row, from a front end that runs the rows itself (the pipeline's
            ``generate_kwargs``); None = what ``PeftModel.generate`` hung on the model, if any.

    Returns:
        None, or the ``Refusal`` of per-row ``adapter_names`` on an engine without slots
        (merged adapters), or of an adapter the slots can't take (its rank grew past them).

    Raises:
        ValueError: stock's, for unknown names or ``adapter_names`` of another length than the
            forward's rows.
    """
    if "peft" not in sys.modules:
        return None
    layers = peft_lora.lora_layers(model)  # one walk over the model's modules per call
    if not layers:
        return None
    if adapter_names is not None:
        adapter_names = peft_lora.checked_names(model, adapter_names, layers)
    named = adapter_names is not None or peft_lora.adapter_names_of(model, layers) is not None
    if engine().lora is None:
        if named:
            return Refusal("peft_adapter_names", "per-row adapter_names on an engine that "
                           "merged its adapters (tensor parallelism)")  # fmt: skip
        return None
    requests = getattr(routed, "requests", None)  # a Native's rows; the others run per call
    rows = len(requests) if requests is not None else len(routed.call.prompts)
    keys, made = [], {}
    for adapter in peft_lora.row_adapters(model, rows, adapter_names, layers):
        if adapter is not None and id(adapter) not in made:
            try:
                made[id(adapter)] = engine().add_lora(adapter)
            except ValueError as e:
                return Refusal("lora_slots", str(e))
        keys.append(None if adapter is None else made[id(adapter)])
    if requests is not None:
        for r, key in zip(requests, keys, strict=True):
            r.lora_key = key
    else:
        routed.call.lora_keys = keys
    return None


def active_lora_key(model, engine) -> str | None:
    """The engine key of the adapters PEFT's forward applies to every row of ``model`` (its
    active adapters), for front ends that build their own requests (lm-eval); None without
    LoRA slots or adapters."""
    if "peft" not in sys.modules or engine.lora is None or not engine.lora.spec.from_peft:
        return None
    adapter = peft_lora.row_adapters(model, 1)[0]
    return None if adapter is None else engine.add_lora(adapter)
