"""hf_paged: a paged-KV engine behind Hugging Face ``generate``.

Public API: ``LLM``, ``SamplingParams``, ``EngineConfig``, ``LLMEngine``.
"""

from hf_paged.config import EngineConfig, SamplingParams
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.engine.outputs import CompletionOutput, RequestOutput
from hf_paged.engine.proposers import DraftModelProposer, NgramProposer
from hf_paged.integration import dispatch as _dispatch
from hf_paged.integration import pipeline as _pipeline
from hf_paged.integration.auto import AutoPagedModelForCausalLM, PagedModelForCausalLM
from hf_paged.integration.datasets_map import paged_generate_map
from hf_paged.integration.dispatch import PagedFallbackWarning, configure, set_default_backend
from hf_paged.llm import LLM
from hf_paged.shard import shard_generate


def install() -> None:
    """Route ``generate`` / ``pipeline`` through the engine when asked (inert otherwise)."""
    _dispatch.install()
    _pipeline.install_pipeline()


def uninstall() -> None:
    """Restore stock ``GenerationMixin.generate`` and ``transformers.pipeline``."""
    _dispatch.uninstall()
    _pipeline.uninstall_pipeline()


install()  # inert until asked: backend="paged", set_default_backend or HF_PAGED_BACKEND

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "LLMEngine",
    "EngineConfig",
    "SamplingParams",
    "RequestOutput",
    "CompletionOutput",
    "DraftModelProposer",
    "NgramProposer",
    "AutoPagedModelForCausalLM",
    "PagedModelForCausalLM",
    "PagedFallbackWarning",
    "paged_generate_map",
    "configure",
    "install",
    "set_default_backend",
    "shard_generate",
    "uninstall",
]
