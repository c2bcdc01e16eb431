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

# arch -> (config class, hidden, layers, attention heads, KV heads, head_dim, intermediate,
#          vocab, tied embeddings, max positions, RMSNorm eps, RoPE theta); RoPE is plain
ARCHS: dict[str, tuple] = {
    "qwen3-0.6b": ("Qwen3Config", 1024, 28, 16, 8, 128, 3072, 151936, True, 40960, 1e-6, 1e6),
    "llama3-8b": ("LlamaConfig", 4096, 32, 32, 8, 128, 14336, 128256, False, 8192, 1e-5, 5e5),
    # Llama-3.2-1B's shape (the 8B's vocabulary, tied): a draft for the 8B
    "llama3.2-1b": ("LlamaConfig", 2048, 16, 32, 8, 64, 8192, 128256, True, 8192, 1e-5, 5e5),
    # a 1-layer llama with tiny's vocabulary: a draft for CPU smoke runs
    "tiny-llama": ("LlamaConfig", 64, 1, 4, 2, 16, 128, 512, True, 256, 1e-6, 1e4),
    "tiny": ("Qwen3Config", 64, 2, 4, 2, 16, 128, 512, True, 256, 1e-6, 1e4),  # qk-norm, GQA
}
# what a config class needs besides the table's numbers
_CLASS_KEYS = {"Qwen3Config": {"use_sliding_window": False}, "LlamaConfig": {"mlp_bias": False}}


def model_config(arch: str):
    """The transformers config of an architecture of ``ARCHS`` (no weights, nothing
    downloaded)."""
    import transformers

    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not allowed: must be one of {sorted(ARCHS)}")
    cls, hidden, layers, heads, kv_heads, head_dim, inter, vocab, tied, positions, eps, theta = (
        ARCHS[arch]
    )
    return getattr(transformers, cls)(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, head_dim=head_dim, intermediate_size=inter,
        vocab_size=vocab, tie_word_embeddings=tied, max_position_embeddings=positions,
        rms_norm_eps=eps, rope_parameters={"rope_type": "default", "rope_theta": theta},
        hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=0,
        attention_bias=False, **_CLASS_KEYS[cls],
    )  # fmt: skip


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
