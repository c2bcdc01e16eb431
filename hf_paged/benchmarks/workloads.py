"""Benchmark workloads (evaluation/README.md, "Workloads"): request sets, model architectures
with random weights, and the environment record every result file carries. ``evaluation/``'s
scripts and ``hf-paged bench`` draw their requests here.

* W1 / W2: 256 requests, prompt lengths U[100, 1024], output lengths U[100, 1024], prompt token
  ids U[0, 10000), ``random.Random(0)``: first every prompt (length, then its ids), then every
  output length (nano-vllm's bench.py order). EOS is ignored, decoding is greedy.
* Architectures, random bf16 weights, nothing downloaded:
  ``qwen3-0.6b`` (W1) = Qwen3-0.6B's config; ``llama3-8b`` (W2, L1) = Llama-3-8B's config with
  plain RoPE (``rope_theta`` 500000, no llama3 scaling, ``max_position_embeddings`` 8192), i.e.
  the original Llama-3-8B, not 3.1. No sequence here is longer than 2048 tokens, where the 3.1
  scaling would change nothing anyway. ``llama3.2-1b`` = Llama-3.2-1B's shape with the same plain
  RoPE (a draft model for the 8B). ``tiny`` is a 2-layer model for CPU smoke runs, ``tiny-llama``
  a 1-layer draft for it.

EOS/BOS are unset in the configs and generation configs (eos_token_id=None, pad_token_id=0), so
stock ``generate`` never stops early and every system generates exactly the requested tokens.
"""

from __future__ import annotations

import contextlib
import datetime
import platform
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_paged import envs

# evaluation/results of the checkout this package sits in (scripts write there by default)
RESULTS_DIR = Path(__file__).resolve().parents[2] / "evaluation" / "results"
_T0 = time.perf_counter()


# ---- requests ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """A request set: prompt token ids and the number of new tokens each request wants."""

    name: str
    arch: str
    prompts: list[list[int]]
    output_lens: list[int]

    def head(self, n: int) -> Workload:
        """The first ``n`` requests (baselines run on a prefix of the set)."""
        return Workload(self.name, self.arch, self.prompts[:n], self.output_lens[:n])

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def make_requests(
    num_requests: int = 256,
    prompt_len: tuple[int, int] = (100, 1024),
    output_len: tuple[int, int] = (100, 1024),
    vocab_limit: int = 10000,
    seed: int = 0,
) -> tuple[list[list[int]], list[int]]:
    """``(prompts, output_lens)``; lengths inclusive on both ends, ids in ``[0, vocab_limit)``."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_limit) for _ in range(rng.randint(*prompt_len))]
        for _ in range(num_requests)
    ]
    output_lens = [rng.randint(*output_len) for _ in range(num_requests)]
    return prompts, output_lens


WORKLOAD_ARCH = {"W1": "qwen3-0.6b", "W2": "llama3-8b"}


def get_workload(name: str, smoke: bool = False) -> Workload:
    """W1 or W2; ``smoke`` = 8 short requests on the tiny model (CPU smoke runs)."""
    if name not in WORKLOAD_ARCH:
        raise ValueError(f"workload={name!r} is not allowed: must be one of {list(WORKLOAD_ARCH)}")
    if smoke:
        prompts, outs = make_requests(8, (4, 32), (4, 16), vocab_limit=500)
        return Workload(name, "tiny", prompts, outs)
    prompts, outs = make_requests()
    return Workload(name, WORKLOAD_ARCH[name], prompts, outs)


# ---- models -----------------------------------------------------------------------------------


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
    arch: str,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    attn_implementation: str = "sdpa",
):
    """An HF causal-LM with random weights, built directly on ``device`` in ``dtype``.

    HF's own init is switched off (``no_init_weights``, then ``tie_weights`` by hand); matrices
    get N(0, 0.02), 1-D weights (RMSNorm scales) 1.0, all from one seeded generator on the
    device: an 8B model takes about a second on a GPU instead of minutes of CPU init.
    """
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.initialization import no_init_weights

    cfg = model_config(arch)
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


# ---- environment / reporting -------------------------------------------------------------------


def log(msg: str) -> None:
    """A progress line with UTC wall clock and seconds since start."""
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S")
    print(f"[{now} +{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


def utc_stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _git(*args: str) -> str | None:
    try:
        return subprocess.check_output(
            ["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=Path(__file__).parent
        ).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def environment() -> dict:
    """git sha (and whether the tree had changes), device, library versions."""
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {
        # the device copy of the tree may carry a stale .git: pass HF_PAGED_GIT_SHA=<sha> there
        "git_sha": envs.HF_PAGED_GIT_SHA or _git("rev-parse", "HEAD"),
        "git_dirty": None if status is None else bool(status),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "host": platform.node(),
        "argv": sys.argv,
        "date_utc": utc_stamp(),
        **envs.recorded(),
        # every HF_PAGED_* switch's value in this run, defaults included (hf_paged/envs.py)
        "hf_paged_envs": envs.snapshot(),
    }


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device) -> None:
    """Return cached allocator blocks, so the next system sizes its cache from real free memory."""
    import gc

    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def mem_str(device) -> str:
    """GPU memory in use / held by the caching allocator / free, for progress lines."""
    if torch.device(device).type != "cuda":
        return "cpu"
    free, total = torch.cuda.mem_get_info(device)
    alloc, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    return (
        f"alloc {alloc / 2**30:.1f} GiB, reserved {reserved / 2**30:.1f}, free {free / 2**30:.1f}"
    )


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    cell = lambda c: str(c).replace("|", "\\|")  # noqa: E731 - "paged|sdpa" inside a cell
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


class TritonCompileLog:
    """Counts the Triton kernels compiled (or loaded from the disk cache) inside a ``with``.

    A compile in the middle of a timed run stalls the host for milliseconds to seconds, so the
    benchmarks report them next to the profile. Uses ``triton.knobs.runtime``'s cache and
    post-compile hooks where this Triton has them (a no-op otherwise); earlier hooks still run.
    """

    def __init__(self):
        self.events: list[tuple[str, float]] = []  # (kernel signature, seconds)
        self._t0: float | None = None

    def __enter__(self):
        try:
            from triton import knobs
        except Exception:  # noqa: BLE001 - no Triton, or one without knobs
            self._rt = None
            return self
        self._rt = knobs.runtime
        self._prev = (self._rt.jit_cache_hook, self._rt.jit_post_compile_hook)
        prev_cache, prev_post = self._prev

        def on_cache(*args, **kwargs):
            self._t0 = time.perf_counter()
            return prev_cache(*args, **kwargs) if prev_cache else None

        def on_post(*args, **kwargs):
            dt = time.perf_counter() - self._t0 if self._t0 is not None else 0.0
            self.events.append((str(kwargs.get("repr", "?")), dt))
            return prev_post(*args, **kwargs) if prev_post else None

        self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = on_cache, on_post
        return self

    def __exit__(self, *exc):
        if self._rt is not None:
            self._rt.jit_cache_hook, self._rt.jit_post_compile_hook = self._prev
        return False

    def summary(self) -> dict:
        return {
            "count": len(self.events),
            "total_s": sum(dt for _, dt in self.events),
            "kernels": [f"{dt * 1e3:.0f} ms {sig[:300]}" for sig, dt in self.events[:20]],
        }
