"""The generic model path: any HF decoder through its own modules with hf_paged's attention."""

from hf_paged.models.generic.model import GenericForCausalLM
from hf_paged.models.generic.support import UnsupportedModelError, static_refusal

__all__ = ["GenericForCausalLM", "UnsupportedModelError", "static_refusal"]
