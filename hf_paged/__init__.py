"""hf_paged: a paged-KV engine behind Hugging Face ``generate``.

Public API: ``LLM`` (with ``LoRARequest``), ``SamplingParams``, ``EngineConfig``, ``LLMEngine`` (and the
``EngineRequest`` its ``add_request`` takes), the HF-shaped
``AutoPagedModelForCausalLM``, ``paged_generate_map`` (``Dataset.map``), ``shard_generate``
(torchrun / SLURM slices), and the switches ``set_default_backend``, ``configure``, ``release``,
``install`` / ``uninstall``. ``hf_paged.ray.map_generate`` (``from hf_paged.ray import
map_generate``, or first access of ``hf_paged.ray``) needs ``ray[data]``; it stays out of
``dir(hf_paged)`` so that ``help(hf_paged)`` works without it. The front ends live in
``entrypoints/``.

``import hf_paged`` has one side effect, ``integration/hooks.install_on_import``: the
``generate`` and ``pipeline`` dispatchers are installed when transformers loads them; they change
nothing until a call passes ``backend="paged"``, ``set_default_backend("paged")`` is called or
``HF_PAGED_BACKEND=paged`` is set. Only when ``HF_PAGED_TIMINGS`` names a file does the same call
also install the timing record and the client's phase spans (``timing/``), which then import
torch and transformers at once to time them. (A mistyped ``HF_PAGED_*`` variable is warned
about at import; that installs nothing.) The names below load on first use, so importing the
package (and the ``hf-paged`` command) costs no torch import.
"""

from __future__ import annotations

import importlib

from hf_paged import envs as _envs
from hf_paged.integration import hooks as _hooks

__version__ = "0.1.0"

# public name -> (module, attribute); imported on first access (attribute None: the module)
_EXPORTS: dict[str, tuple[str, str | None]] = {
    "LLM": ("hf_paged.entrypoints.llm", "LLM"),
    "LLMEngine": ("hf_paged.engine.llm_engine", "LLMEngine"),
    "EngineRequest": ("hf_paged.engine.core.request", "EngineRequest"),
    "LoRARequest": ("hf_paged.entrypoints.lora_request", "LoRARequest"),
    "EngineConfig": ("hf_paged.config", "EngineConfig"),
    "SamplingParams": ("hf_paged.config", "SamplingParams"),
    "RequestOutput": ("hf_paged.engine.core.outputs", "RequestOutput"),
    "CompletionOutput": ("hf_paged.engine.core.outputs", "CompletionOutput"),
    "NgramProposer": ("hf_paged.engine.spec.proposers", "NgramProposer"),
    "DraftModelProposer": ("hf_paged.engine.spec.proposers", "DraftModelProposer"),
    "AutoPagedModelForCausalLM": ("hf_paged.integration.auto", "AutoPagedModelForCausalLM"),
    "PagedModelForCausalLM": ("hf_paged.integration.auto", "PagedModelForCausalLM"),
    "PagedFallbackWarning": ("hf_paged.integration.fallback", "PagedFallbackWarning"),
    "paged_generate_map": ("hf_paged.entrypoints.datasets_map", "paged_generate_map"),
    "shard_generate": ("hf_paged.entrypoints.torchrun", "shard_generate"),
    "ray": ("hf_paged.ray", None),
    "configure": ("hf_paged.integration.dispatch", "configure"),
    "release": ("hf_paged.integration.dispatch", "release"),
    "set_default_backend": ("hf_paged.integration.dispatch", "set_default_backend"),
    "get_default_backend": ("hf_paged.integration.dispatch", "get_default_backend"),
}


def __getattr__(name: str):
    entry = _EXPORTS.get(name)
    if entry is None:
        raise AttributeError(f"module 'hf_paged' has no attribute {name!r}")
    module = importlib.import_module(entry[0])
    value = module if entry[1] is None else getattr(module, entry[1])
    globals()[name] = value  # later lookups skip this function
    return value


# names that need an optional package: loaded on access, but left out of ``dir()`` (``help`` and
# ``inspect.getmembers`` read every name ``dir()`` lists) and of ``import *``
_OPTIONAL = ("ray",)


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS} - set(_OPTIONAL))


def install() -> None:
    """Route ``generate`` / ``pipeline`` through the engine when asked (inert otherwise); loads
    transformers' generation and pipeline modules now."""
    from hf_paged.integration import dispatch, pipeline

    dispatch.install()
    pipeline.install_pipeline()


def uninstall() -> None:
    """Restore stock ``GenerationMixin.generate`` and ``transformers.pipeline``."""
    import sys

    _hooks.cancel()
    if "hf_paged.integration.dispatch" in sys.modules:
        sys.modules["hf_paged.integration.dispatch"].uninstall()
    if "hf_paged.integration.pipeline" in sys.modules:
        sys.modules["hf_paged.integration.pipeline"].uninstall_pipeline()


_envs.warn_unknown()  # a mistyped HF_PAGED_* variable is said now, not at the first engine
_hooks.install_on_import()  # the dispatchers (and the timing hooks when HF_PAGED_TIMINGS is set)

__all__ = [*(n for n in _EXPORTS if n not in _OPTIONAL), "install", "uninstall", "__version__"]
