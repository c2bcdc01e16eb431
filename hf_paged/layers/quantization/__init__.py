"""Quantized linear layers: which checkpoints are served (``fp8_config``) and their layers."""

from hf_paged.layers.quantization.fp8_config import (
    Fp8Config,
    UnsupportedQuantizationError,
    fp8_config_of,
    unserved_quantization,
)

__all__ = ["Fp8Config", "UnsupportedQuantizationError", "fp8_config_of", "unserved_quantization"]
