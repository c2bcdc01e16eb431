"""Model architectures of the benchmarks with random weights, nothing downloaded, and what an
engine is given as its model.

``qwen3-0.6b`` (W1) = Qwen3-0.6B's config; ``llama3-8b`` (W2, L1) = Llama-3-8B's config with
plain RoPE (``rope_theta`` 500000, no llama3 scaling, ``max_position_embeddings`` 8192), i.e. the
original Llama-3-8B, not 3.1. No sequence here is longer than 2048 tokens, where the 3.1 scaling
would change nothing anyway. ``llama3.2-1b`` = Llama-3.2-1B's shape with the same plain RoPE (a
draft model for the 8B). ``tiny`` is a 2-layer model for CPU smoke runs, ``tiny-llama`` a 1-layer
draft for it.

EOS/BOS are unset in the configs and generation configs (eos_token_id=None, pad_token_id=0), so
stock ``generate`` never stops early and every system generates exactly the requested tokens.
"""

from __future__ import annotations

import contextlib
import tempfile
import time

import torch

from hf_paged.benchmarks.run_record import log


def model_config(arch: str):
    """The transformers config of an architecture (no weights, nothing downloaded)."""
    from transformers import LlamaConfig, Qwen3Config

    common = dict(bos_token_id=None, eos_token_id=None, pad_token_id=0, attention_bias=False)
    if arch == "qwen3-0.6b":
        return Qwen3Config(
            hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, intermediate_size=3072, vocab_size=151936,
            tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
            hidden_act="silu", use_sliding_window=False, **common,
        )  # fmt: skip
    if arch == "llama3-8b":
        return LlamaConfig(
            hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
            num_key_value_heads=8, head_dim=128, intermediate_size=14336, vocab_size=128256,
            tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
            hidden_act="silu", mlp_bias=False, **common,
        )  # fmt: skip
    if arch == "llama3.2-1b":  # Llama-3.2-1B's shape (the 8B's vocabulary, tied), plain RoPE
        return LlamaConfig(
            hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
            num_key_value_heads=8, head_dim=64, intermediate_size=8192, vocab_size=128256,
            tie_word_embeddings=True, max_position_embeddings=8192, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 500_000.0},
            hidden_act="silu", mlp_bias=False, **common,
        )  # fmt: skip
    if arch == "tiny-llama":  # a 1-layer llama with tiny's vocabulary (a draft for CPU smoke runs)
        return LlamaConfig(
            hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            hidden_act="silu", mlp_bias=False, **common,
        )  # fmt: skip
    if arch == "tiny":  # Qwen3-shaped (qk-norm, GQA, tied), 2 layers
        return Qwen3Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, vocab_size=512, tie_word_embeddings=True,
            max_position_embeddings=256, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            hidden_act="silu", use_sliding_window=False, **common,
        )  # fmt: skip
    raise ValueError(
        f"arch={arch!r} is not allowed: must be qwen3-0.6b, llama3-8b, llama3.2-1b, tiny or "
        "tiny-llama"
    )


def build_random_model(
    arch,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """An HF causal-LM with random weights, built directly on ``device`` in ``dtype``; ``arch``
    is an architecture name above or a transformers config of its own.

        HF's own init is switched off (``no_init_weights``, then ``tie_weights`` by hand); matrices
        get N(0, 0.02), 1-D weights (RMSNorm scales) 1.0, all from one seeded generator on the
        device: an 8B model takes about a second on a GPU instead of minutes of CPU init.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    cfg = model_config(arch) if isinstance(arch, str) else arch
    with torch.device(device), no_init_weights():
        model = AutoModelForCausalLM.from_config(
            cfg, dtype=dtype, attn_implementation=attn_implementation
        )
    if any(p.device.type != torch.device(device).type for p in model.parameters()):
        log(f"build_random_model: from_config ignored the device context; moving to {device}")
        model.to(device)  # slow for big models on the host; should not happen with transformers 5
    model.tie_weights()  # normally done by the init_weights that no_init_weights skips
    if cfg.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # tied weights appear once
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    model.eval()
    model.generation_config = GenerationConfig(
        do_sample=False, bos_token_id=None, eos_token_id=None, pad_token_id=0
    )
    return model


@contextlib.contextmanager
def engine_source(model, tensor_parallel_size: int, tmp_dir: str | None = None):
    """What ``hf_paged.LLM`` is given as its model, and the engine keys that go with it.

    Yields ``(source, extra_engine_kwargs)``. At tensor_parallel_size 1: the in-memory ``model``
    (the engine shares its weights). Above: a checkpoint directory of it (``save_pretrained``,
    safetensors) in ``tmp_dir`` (default: the system's temp dir; an 8B bf16 model takes 16 GB),
    removed on exit, because each rank loads its own shard from disk and an in-memory model
    only lives in rank 0's process; the extra keys name the model's device and the rank count.
    """
    if tensor_parallel_size == 1:
        yield model, {}
        return
    with tempfile.TemporaryDirectory(prefix="hf_paged_bench_tp_", dir=tmp_dir) as path:
        t = time.perf_counter()
        model.save_pretrained(path)
        dt = time.perf_counter() - t
        log(f"tp={tensor_parallel_size}: saved the model to {path} in {dt:.1f} s")
        yield path, {"tensor_parallel_size": tensor_parallel_size, "device": str(model.device)}


def weight_bytes(model) -> int:
    """Bytes of the model's parameters (tied ones counted once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())
