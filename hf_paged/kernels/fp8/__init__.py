"""FP8 kernels: activation quantization (alone and fused into the norm / SiLU producers), the
block-scale GEMMs (cuBLASLt block-wise, Triton, the decode GEMV) and the measured per-shape path
table (``fp8_paths.json``), each beside its torch reference."""
