"""``LoRARequest`` (vLLM's shape) and how ``LLM`` turns it into engine adapter keys.

``LLM.generate(..., lora_request=...)`` takes one ``LoRARequest`` for every prompt or a list with
one per prompt (None: the base model). Each names a directory saved by PEFT's
``save_pretrained``; ``LoraResolver`` loads it once and registers it with the engine
(``LLMEngine.add_lora``), and loads it again from disk when the engine's host cache evicted it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from hf_paged.models.adapters import LoraAdapter, load_adapter_dir


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter for some prompts (vLLM's ``vllm.lora.request.LoRARequest``).

    Args:
        lora_name: its name (in error messages and in its engine key).
        lora_int_id: a positive id the caller chose; two requests with one id are one adapter.
        lora_path: the directory PEFT's ``save_pretrained`` wrote.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name={self.lora_name!r} is not allowed: a non-empty str")
        if (
            isinstance(self.lora_int_id, bool)
            or not isinstance(self.lora_int_id, int)
            or (self.lora_int_id < 1)
        ):
            raise ValueError(f"lora_int_id={self.lora_int_id!r} is not allowed: an int >= 1")
        object.__setattr__(self, "lora_path", os.fspath(self.lora_path))


class LoraResolver:
    """Per ``LLM``: ``LoRARequest`` -> the engine's key for it."""

    def __init__(self):
        self._keys: dict[int, tuple[LoRARequest, str]] = {}  # lora_int_id -> (request, key)

    def keys_for(self, engine, lora_request, num_prompts: int) -> list[str | None]:
        """One engine key per prompt (None: the base model); every adapter is registered.

        Raises:
            ValueError: a list of the wrong length, something not a ``LoRARequest``, more
                distinct adapters than the engine keeps, or an adapter the engine can't serve
                (each names the adapter); nothing is queued then.
        """
        if lora_request is None or isinstance(lora_request, LoRARequest):
            per = [lora_request] * num_prompts
        elif isinstance(lora_request, Seq) and not isinstance(lora_request, str):
            per = list(lora_request)
            if len(per) != num_prompts:
                raise ValueError(
                    f"lora_request has {len(per)} entries but there are {num_prompts} prompts: "
                    "give one LoRARequest (or None) or one per prompt"
                )
        else:
            raise TypeError(f"lora_request={lora_request!r} is not allowed: a LoRARequest, "
                            "None, or a list of them (one per prompt)")  # fmt: skip
        for r in per:
            if r is not None and not isinstance(r, LoRARequest):
                raise TypeError(f"lora_request entry {r!r} is not allowed: a LoRARequest or None")
        distinct = {r.lora_int_id: r for r in per if r is not None}
        lora = engine.lora
        if distinct and lora is not None and len(distinct) > lora.spec.max_cpu_loras:
            raise ValueError(
                f"lora_request names {len(distinct)} adapters in one call, above max_cpu_loras="
                f"{lora.spec.max_cpu_loras}: raise max_cpu_loras or split the call"
            )
        keys = {i: self._key(engine, r) for i, r in distinct.items()}
        return [None if r is None else keys[r.lora_int_id] for r in per]

    def _key(self, engine, request: LoRARequest) -> str:
        known = self._keys.get(request.lora_int_id)
        if (
            known is not None
            and known[0] == request
            and engine.lora is not None
            and (engine.lora.has(known[1]))
        ):
            return engine.lora.add(engine.lora.adapters[known[1]])  # marks it recently used
        adapter: LoraAdapter = load_adapter_dir(request.lora_name, request.lora_path)
        key = engine.add_lora(adapter)
        self._keys[request.lora_int_id] = (request, key)
        return key
