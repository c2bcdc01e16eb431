"""hf_paged: a paged-KV engine behind Hugging Face ``generate``.

Public API: ``LLM``, ``SamplingParams``, ``EngineConfig``, ``LLMEngine``.
"""

from hf_paged.config import EngineConfig, SamplingParams
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.integration.dispatch import (
    PagedFallbackWarning,
    configure,
    install,
    set_default_backend,
    uninstall,
)

install()  # inert until asked: backend="paged", set_default_backend or HF_PAGED_BACKEND
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.llm import LLM

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "PagedFallbackWarning",
    "configure",
    "install",
    "set_default_backend",
    "uninstall",
]
