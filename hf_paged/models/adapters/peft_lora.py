"""An in-memory PEFT model's LoRA adapters served from slots, as PEFT's own forward applies them.

``unmerged_refusal`` says whether the model's tuner layers are all plain, unmerged LoRA on the
projections the engine wraps (otherwise the engine merges the active adapters into its weights,
``models/peft.py``, and rebuilds when they change). When they are, the engine loads the base
weights and each call says per row which adapter runs (``row_adapters``):

* ``generate(adapter_names=[...])`` through ``PeftModel.generate``: PEFT has checked the names
  (unknown ones, training mode) and repeated them per beam, and hung them on every LoRA layer in
  a forward pre-hook (``adapter_names_of`` reads them there). Row ``i`` runs adapter
  ``adapter_names[i]`` alone in every layer that has it, ``"__base__"`` none (PEFT's
  ``_mixed_batch_forward``). A length other than the forward's row count raises stock's
  ``ValueError`` (``num_return_sequences > 1`` repeats the rows but not the names).
* otherwise every row runs each layer's active adapters, summed; none inside
  ``disable_adapter()`` (PEFT installs no hooks then, so ``adapter_names`` is ignored too).

Merged adapters, DoRA and other variants make the model ineligible, so their calls take the
merged path, where ``adapter_names`` falls back to stock and stock raises its own error.
"""

from __future__ import annotations

import torch

from hf_paged.models import peft
from hf_paged.models.adapters.adapter import LoraAdapter, from_peft_layers
from hf_paged.models.peft import is_adapter_names_hook, unmerged_refusal

BASE = "__base__"


def lora_layers(model, tuners: dict | None = None) -> dict:
    """``{module name: lora.Linear}`` of the HF model inside ``model`` (of ``tuners``, its
    ``tuner_modules``, when the caller has them: each walk visits every module)."""
    if tuners is None:
        tuners = peft.tuner_modules(peft.unwrap(model))
    return {n: m for n, m in tuners.items() if hasattr(m, "lora_A")}


def adapter_names_of(model, layers: dict | None = None) -> list[str] | None:
    """The ``adapter_names`` PEFT hung on the model's LoRA layers for this call, or None."""
    for m in (lora_layers(model) if layers is None else layers).values():
        for hook in m._forward_pre_hooks.values():
            if is_adapter_names_hook(hook):
                return list(hook.keywords["adapter_names"])
    return None


def max_rank(model, layers: dict | None = None) -> int:
    layers = lora_layers(model) if layers is None else layers
    return max((a.weight.shape[0] for m in layers.values() for a in m.lora_A.values()),
               default=0)  # fmt: skip


def adapter_dtype(model, layers: dict | None = None) -> torch.dtype | None:
    for m in (lora_layers(model) if layers is None else layers).values():
        for a in m.lora_A.values():
            return a.weight.dtype
    return None


def checked_names(model, names, layers: dict | None = None) -> list[str] | None:
    """``adapter_names`` given to a front end that runs rows itself, checked as
    ``PeftModel.generate`` checks them: ignored while the adapters are disabled.

    Raises:
        ValueError: stock's, in training mode or for names no layer has.
    """
    tuners = lora_layers(model) if layers is None else layers
    if not _active(tuners):  # PEFT installs no hooks: the names are dropped
        return None
    if peft.unwrap(model).training:
        raise ValueError("Cannot pass `adapter_names` when the model is in training mode.")
    known = {a for m in tuners.values() for a in m.lora_A}
    unknown = {n for n in names if n != BASE} - known
    if unknown:
        raise ValueError(
            f"Trying to infer with non-existing adapter(s): {', '.join(sorted(unknown))}"
        )
    return list(names)


def row_adapters(model, num_rows: int, names=None, layers: dict | None = None
                 ) -> list[LoraAdapter | None]:  # fmt: skip
    """Per forward row (``num_rows``: inputs x beams or x return sequences), the adapter it runs
    under (None: the base model). See the module docstring.

    Args:
        names: per-row adapter names (``checked_names``); None = those PEFT hung on the model.

    Raises:
        ValueError: stock's own, for ``adapter_names`` of another length than the rows.
    """
    tuners = lora_layers(model) if layers is None else layers
    names = adapter_names_of(model, tuners) if names is None else names
    if names is None:
        active = from_peft_layers("+".join(_active(tuners)) or BASE, tuners, None)
        return [active if active.layers else None] * num_rows
    if len(names) != num_rows:
        raise ValueError(
            "Length of `adapter_names` should be the same as the number of inputs, but got "
            f"{len(names)} and {num_rows} respectively."
        )
    made: dict[str, LoraAdapter | None] = {}
    for n in set(names):
        made[n] = None if n == BASE else from_peft_layers(n, tuners, (n,))
        if made[n] is not None and not made[n].layers:
            made[n] = None
    return [made[n] for n in names]


def _active(tuners: dict) -> list[str]:
    seen: list[str] = []
    for m in tuners.values():
        if not m.disable_adapters:
            seen += [a for a in m.active_adapters if a not in seen]
    return seen


def fingerprint_state(model, tuners: dict | None = None) -> tuple:
    """What the engine was built from, apart from the base weights: whether slots serve the
    adapters (then their changes need no rebuild; each call reads them) or they are merged."""
    tuners = peft.tuner_modules(peft.unwrap(model)) if tuners is None else tuners
    if unmerged_refusal(model, tuners) is None:  # a rank above the slots' builds wider ones
        layers = lora_layers(model, tuners)
        return ("lora_slots", max(16, max_rank(model, layers)), adapter_dtype(model, layers))
    return peft.adapter_state(model)


def is_adapter_parameter(name: str) -> bool:
    """A LoRA factor's parameter name (``...lora_A.<adapter>.weight``)."""
    return ".lora_A." in name or ".lora_B." in name
