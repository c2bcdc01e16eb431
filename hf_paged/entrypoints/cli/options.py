"""Command-line options several ``hf-paged`` commands share: the engine's, and the model path."""

from __future__ import annotations

import argparse

from hf_paged.paths import is_checkpoint_dir, not_a_checkpoint

DTYPES = ("auto", "float32", "float16", "bfloat16")
_ENGINE_KEYS = (
    "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks", "kv_block_size",
    "tensor_parallel_size", "device", "dtype", "enforce_eager",
)  # fmt: skip


def add_engine_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine options (EngineConfig keys; unset = the engine's default)")
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--num-kv-blocks", type=int)
    g.add_argument("--kv-block-size", type=int)
    g.add_argument("--tensor-parallel-size", type=int)
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    g.add_argument("--dtype", choices=DTYPES)
    g.add_argument("--enforce-eager", action="store_true", default=None)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as EngineConfig keys."""
    return {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k) is not None}


def check_model_path(parser: argparse.ArgumentParser, path: str) -> None:
    """Exit with a usage error unless ``path`` is a local checkpoint directory."""
    if not is_checkpoint_dir(path):
        parser.error(not_a_checkpoint("MODEL_PATH", path))
