"""Which weights of an in-memory model changed since its engine last read them.

An engine built from an in-memory HF model shares the model's tensors where the layouts match,
and holds copies where they don't: fused ``qkv_proj`` / ``gate_up_proj``, weights converted to
another dtype, LoRA merged into a base weight, a generic path's fused group. No copy may outlive
a change to its source, so before every paged call the engine's owner
(``integration/engine_owner.py``) asks a ``WeightWatch``:

* ``layout_changed``: a parameter was replaced (another storage, shape, dtype or device), added
  or removed, or the PEFT adapter state moved (active adapter, enabled, merged, scaling): the
  engine is rebuilt, since its shared tensors are the old storage.
* ``changed``: the parameters whose values may have moved, mapped to the served (HF) names they
  feed (a LoRA factor feeds its layer's merged weight). The engine copies just those again into
  its own tensors, in place (``LLMEngine.refresh_weights``): no rebuild, the KV cache and CUDA
  graphs stay, only the prefix cache is dropped (its keys and values are the old weights').

Change is detected three ways, none trusted alone:

1. Optimizer steps. ``torch.optim.optimizer.register_optimizer_step_post_hook`` runs after the
   ``step`` of every ``torch.optim.Optimizer`` (fused, foreach or for-loop; TRL and
   transformers' ``Trainer`` use these). Fused kernels update parameters without bumping their
   version counters, so this hook is what sees them: it marks, in every live watch, the
   parameters of the optimizer's groups.
2. Version counters, compared per call: an in-place op through autograd's view of a tensor
   (``copy_`` under ``no_grad``, ``load_state_dict``, ``mul_``) bumps them.
3. A probe, compared per call: a few elements of every parameter (first, last and evenly spread),
   gathered into one tensor and compared with the copy taken at the last sync. It sees writes
   the other two cannot (``param.data.copy_(...)``, a fused kernel called outside an optimizer)
   whenever they touch a probed element, as any whole-tensor update does. A write through
   ``.data`` that leaves every probed element alone is not seen: ``hf_paged.release(model)``
   after it.

The hook and the probe are ``weight_stamp.py``'s, shared with the LoRA slots' adapter keys.

Costs per call: one pass over the parameters' attributes (the layout key) and one gather of
``PROBE_ELEMENTS`` elements per parameter (about 6 ms for a 135M model's 272 parameters on a
loaded CPU); per optimizer step, one dictionary lookup per parameter of its groups. The hook is
held by every watch and removed with the last holder.

An engine built from a checkpoint directory (a tensor-parallel one, each rank holding its shard)
has no model to watch: ``LLM.update_weights`` sends it new weights, every rank copying its part.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

from hf_paged.models import peft, weight_stamp
from hf_paged.models.adapters import peft_lora


class WeightWatch:
    """The parameters of one in-memory model as its engine last read them.

    Args:
        model: the HF model (a ``PeftModel``: the model inside it), read at construction as the
            engine was built from it.
        lora_slots: the engine serves the model's LoRA from slots (``models/adapters``), reading
            the adapters at every call: their factors and state are not watched, so adding,
            switching or updating adapters neither rebuilds nor refreshes anything.
    """

    def __init__(self, model: nn.Module, lora_slots: bool = False):
        weight_stamp.hold_hook(self)  # fused steps: ``mark``
        model = peft.unwrap(model)
        self._slots = lora_slots
        self._params = {n: p for n, p in model.named_parameters()  # tied ones once
                        if not (lora_slots and peft_lora.is_adapter_parameter(n))}  # fmt: skip
        self._served = peft.served_names(model)  # param name -> served names it feeds
        self._by_id = {id(p): n for n, p in self._params.items()}
        self._index = {n: weight_stamp.probe_index(p) for n, p in self._params.items()}
        self._order = list(self._params)  # the probe's order
        self._layout = self.layout_key(model, lora_slots)
        self._marked: set[str] = set()
        self._mark_lock = threading.Lock()
        self._versions: dict[str, int] = {}
        self._probe: torch.Tensor | None = None
        self.synced()
        weakref.finalize(self, weight_stamp.release_hook)

    @staticmethod
    def layout_key(model: nn.Module, lora_slots: bool = False) -> tuple:
        """Storage, layout of every parameter and the PEFT adapter state: what a refresh in
        place cannot follow. With ``lora_slots``: the base parameters, and whether the adapters
        can still be served from slots (``peft_lora.fingerprint_state``)."""
        model = peft.unwrap(model)
        params = tuple(
            (n, p.data_ptr(), p.dtype, p.device, tuple(p.shape))
            for n, p in model.named_parameters()
            if not (lora_slots and peft_lora.is_adapter_parameter(n))
        )  # fmt: skip
        if lora_slots:
            return params, peft_lora.fingerprint_state(model)
        return params, peft.adapter_state(model)

    def layout_changed(self, model: nn.Module) -> bool:
        return self.layout_key(model, self._slots) != self._layout

    def mark(self, param_ids: set[int]) -> None:
        """An optimizer stepped the parameters with these ids (the step hook)."""
        hit = [self._by_id[i] for i in param_ids if i in self._by_id]
        if hit:
            with self._mark_lock:
                self._marked.update(hit)

    def _gather(self) -> torch.Tensor:
        """[sum of probe sizes] fp32 on the CPU, in ``_order`` (``weight_stamp.gather``)."""
        return weight_stamp.gather([self._params[n] for n in self._order],
                                   [self._index[n] for n in self._order])  # fmt: skip

    def changed(self) -> set[str]:
        """Served names whose values may differ from the last sync (hook marks, version
        counters, probe); call ``layout_changed`` first."""
        with self._mark_lock:
            names = set(self._marked)
        for n, p in self._params.items():
            if p._version != self._versions[n]:
                names.add(n)
        probe = self._gather()
        if not torch.equal(probe, self._probe):
            start = 0
            for n in self._order:
                k = self._index[n].numel()
                if not torch.equal(probe[start : start + k], self._probe[start : start + k]):
                    names.add(n)
                start += k
        return {s for n in names for s in self._served.get(n, (n,))}

    def synced(self) -> None:
        """The engine now holds the current values: remember versions and probe, clear marks."""
        with self._mark_lock:
            self._marked.clear()
        self._versions = {n: p._version for n, p in self._params.items()}
        self._probe = self._gather()
