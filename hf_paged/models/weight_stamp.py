"""What moves when a tensor's values change in place, for those who keep a copy of it.

Version counters alone miss two kinds of write: fused optimizer kernels (``AdamW(fused=True)``,
``SGD(fused=True)``) update parameters without bumping them, and writes through ``.data`` bump
nothing. Two more signals, cheap enough to read per call:

* ``optimizer_steps``: a count of every ``torch.optim.Optimizer.step`` in the process, from
  ``torch.optim.optimizer.register_optimizer_step_post_hook``. The hook is registered while
  someone holds it (``hold_hook`` / ``release_hook``) and removed with the last holder, so the
  host is left as it was found. Listeners (the weight watches) hear which parameters stepped.
* ``probe``: a few elements of each tensor (first, last, evenly between), gathered with one copy
  to the host per device. Any whole-tensor update moves them.

Users: ``weight_watch.py`` (which weights of an in-memory model an engine must copy again) and
the LoRA slots' adapter digests (``adapters/adapter.py``: a live adapter's key).
"""

from __future__ import annotations

import threading
import weakref

import torch

PROBE_ELEMENTS = 4  # per tensor: its first, last and two between

_lock = threading.Lock()
_handle = None  # torch's handle of the step hook, held while someone holds it
_holders = 0
_steps = 0  # optimizer steps the hook has seen
_listeners: weakref.WeakSet = weakref.WeakSet()  # objects with ``mark(param_ids)``


def _on_optimizer_step(optimizer, args, kwargs) -> None:
    global _steps
    _steps += 1
    if not _listeners:
        return
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for listener in list(_listeners):
        listener.mark(ids)


def hold_hook(listener=None) -> None:
    """Keep the step hook registered (and tell ``listener.mark(ids)`` of each step's
    parameters) until a matching ``release_hook``."""
    global _handle, _holders
    with _lock:
        _holders += 1
        if listener is not None:
            _listeners.add(listener)
        if _handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            _handle = register_optimizer_step_post_hook(_on_optimizer_step)


def release_hook() -> None:
    """One holder less; the hook is removed with the last."""
    global _handle, _holders
    with _lock:
        _holders -= 1
        if _holders == 0 and _handle is not None:
            _handle.remove()
            _handle = None


def hook_installed() -> bool:
    """The optimizer step hook is registered."""
    return _handle is not None


def holders() -> int:
    """How many hold the hook now."""
    return _holders


def optimizer_steps() -> int | None:
    """Optimizer steps seen so far (any optimizer), or None while the hook is not held."""
    return _steps if _handle is not None else None


def probe_index(t: torch.Tensor) -> torch.Tensor:
    """Flat indices of the probed elements: first, last and evenly between (integer math: a
    float32 linspace rounds past the end of a large tensor)."""
    n = t.numel()
    k = min(PROBE_ELEMENTS, n)
    idx = [i * (n - 1) // (k - 1) for i in range(k)] if k > 1 else [0] * k
    return torch.tensor(idx, dtype=torch.long, device=t.device)


def gather(tensors: list[torch.Tensor], indices: list[torch.Tensor]) -> torch.Tensor:
    """[sum of index sizes] fp32 on the CPU, in the order given: one gather per tensor, one
    copy to the host per device."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, (t, idx) in enumerate(zip(tensors, indices, strict=True)):
        by_device.setdefault(t.device, []).append((i, t.detach().reshape(-1)[idx].float()))
    parts: list[torch.Tensor | None] = [None] * len(tensors)
    for items in by_device.values():
        host = torch.cat([p for _, p in items]).cpu()
        start = 0
        for i, p in items:
            parts[i] = host[start : start + p.numel()]
            start += p.numel()
    return torch.cat(parts) if parts else torch.zeros(0)


def probe(tensors: list[torch.Tensor]) -> bytes:
    """The probed elements of ``tensors`` as bytes (part of a stamp)."""
    return gather(tensors, [probe_index(t) for t in tensors]).numpy().tobytes()
