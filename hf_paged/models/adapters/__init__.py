"""Many LoRA adapters on one engine: unmerged, in slots, chosen per request.

Design
------
* **Identity.** An adapter is a ``LoraAdapter``: per adapted HF module ``A [r, in]``, ``B [out, r]``
  and a scaling, under the key ``"name@digest"`` (sha256 of every factor and scaling,
  ``adapter.py``). Requests carry the key (``EngineRequest.lora_key`` -> ``Sequence.lora_key``
  -> ``ScheduledChunk.lora_key``). The prefix cache chains a sequence's first block from its key,
  so every cached block is keyed by the adapter its KV was computed under; an adapter reloaded
  under the same name with other weights has another key and shares nothing.
* **Slots.** ``LoraManager`` (``manager.py``, on the runner): a host-side cache of registered
  adapters (``max_cpu_loras``, LRU) and ``max_loras`` device slots per wrapped layer, rank
  ``max_lora_rank`` (smaller ranks zero-padded). The scheduler admits at most ``max_loras``
  distinct adapters among running sequences; before each forward the manager gives every token
  its sequence's slot (loading adapters into free or least recently used slots).
* **Layers.** ``layers.py`` wraps the decoder's ``q/k/v/o/gate/up/down`` projections in place:
  the base GEMM runs once, then each slice (the native path's fused ``qkv_proj`` is three,
  ``gate_up_proj`` two) adds ``scale * B(A(x))`` for its tokens, grouped by slot
  (``kernels/lora_segmented.py``: Punica-style shrink and expand in Triton on CUDA, the torch
  reference elsewhere). A step whose tokens all share one adapter skips the grouping. The native
  path wraps its fused layers, the generic and hybrid paths the HF model's own ``nn.Linear``
  modules. Only ``tensor_parallel_size=1`` (a row-parallel layer's delta would have to follow
  its all-reduce on every rank): with TP, ``enable_lora`` is refused by name and a PEFT model
  is served merged.
* **Sources.** ``LLM(..., enable_lora=True)`` / ``LLMEngine.add_lora`` take adapters saved by
  PEFT (``load_adapter_dir``). An in-memory PEFT model whose adapters are all plain LoRA on those
  projections (``models/peft.py``'s ``unmerged_refusal``) gets slots automatically: the engine loads its
  base weights, and each ``generate`` call reads the adapters it needs from the live model
  (``peft_lora.row_adapters``: per-row ``adapter_names``, or the active adapters summed), so
  ``load_adapter``/``add_adapter``/``delete_adapter``, ``set_adapter`` and in-place updates of
  the factors show in the next call without a rebuild (a new digest is a new key). Anything else
  (DoRA, merged adapters, ``modules_to_save``, LoRA on embeddings) keeps the merged path.
"""

from __future__ import annotations

import os

from hf_paged.models.adapters.adapter import LoraAdapter, LoraFactors, load_adapter_dir
from hf_paged.models.adapters.manager import LoraManager, LoraSpec


def lora_spec(model, config) -> LoraSpec | None:
    """The engine's LoRA slots for ``model`` (a checkpoint directory, an HF model or a
    ``PeftModel``) under ``config``, or None for none.

    Raises:
        ValueError: ``enable_lora`` with ``tensor_parallel_size > 1``.
    """
    cpu = config.max_cpu_loras or max(config.max_loras, 16)
    if config.enable_lora:
        if config.tensor_parallel_size > 1:
            raise ValueError(
                f"enable_lora=True is not allowed with tensor_parallel_size="
                f"{config.tensor_parallel_size}: LoRA slots are served on one rank; use "
                "tensor_parallel_size=1"
            )
        return LoraSpec(config.max_loras, config.max_lora_rank, cpu)
    if isinstance(model, (str, os.PathLike)) or config.tensor_parallel_size > 1:
        return None
    from hf_paged.models import peft
    from hf_paged.models.adapters import peft_lora

    if not peft.tuner_modules(peft.unwrap(model)) or peft_lora.unmerged_refusal(model):
        return None

    rank = max(config.max_lora_rank, 16, peft_lora.max_rank(model))  # see fingerprint_state
    dtype = peft_lora.adapter_dtype(model)
    return LoraSpec(config.max_loras, rank, cpu, str(dtype).removeprefix("torch."), from_peft=True)


__all__ = ["LoraAdapter", "LoraFactors", "LoraManager", "LoraSpec", "load_adapter_dir",
           "lora_spec"]  # fmt: skip
