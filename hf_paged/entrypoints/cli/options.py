"""Command-line options several ``hf-paged`` commands share: the engine's, and the model path.

Every option has a help line that ends with its default (``--help`` shows them all); the
engine's defaults are read from ``EngineConfig`` itself, so the two cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from hf_paged.entrypoints.cli.errors import CliError
from hf_paged.paths import is_checkpoint_dir, not_a_checkpoint

DTYPES = ("auto", "float32", "float16", "bfloat16")
# EngineConfig key -> (metavar, what it is); the default comes from EngineConfig
_ENGINE_OPTIONS = {
    "max_num_seqs": ("N", "most sequences decoded in one step"),
    "max_num_batched_tokens": ("N", "most tokens in one step (prefill chunks and decodes)"),
    "max_model_len": ("N", "longest prompt + output"),
    "num_kv_blocks": ("N", "KV cache blocks"),
    "kv_block_size": ("N", "tokens per KV cache block"),
    "tensor_parallel_size": ("N", "processes the model is split over (gloo on CPU, NCCL on GPU)"),
    "device": ("DEVICE", "cpu, cuda or cuda:N"),
    "dtype": (None, "weights and activations"),
    "enforce_eager": (None, "no CUDA graphs"),
}
# how a None default reads
_NONE_DEFAULTS = {
    "max_model_len": "the model's",
    "num_kv_blocks": "sized from memory",
    "device": "cuda if available, else cpu",
}
# the engine keys left unset are the engine's defaults: unset options stay None here
_ENGINE_KEYS = tuple(_ENGINE_OPTIONS)


def add_engine_options(p: argparse.ArgumentParser) -> None:
    from hf_paged.config import EngineConfig

    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    g = p.add_argument_group("engine options (EngineConfig keys)")
    for key, (metavar, what) in _ENGINE_OPTIONS.items():
        default = defaults[key]
        shown = _NONE_DEFAULTS[key] if default is None else default
        flag = "--" + key.replace("_", "-")
        if key == "enforce_eager":
            g.add_argument(flag, action="store_true", default=None, help=f"{what} (default: off)")
        elif key == "dtype":
            g.add_argument(
                flag, choices=DTYPES, help=f"{what} (default: {shown}: the checkpoint's)"
            )
        else:
            kind = str if key == "device" else int
            g.add_argument(flag, type=kind, metavar=metavar, help=f"{what} (default: {shown})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options given on the command line, as EngineConfig keys."""
    return {k: getattr(args, k) for k in _ENGINE_KEYS if getattr(args, k) is not None}


def check_engine_options(args: argparse.Namespace) -> None:
    """Raise CliError for an engine option out of range, before anything loads."""
    from hf_paged.config import EngineConfig

    try:
        EngineConfig.from_dict(engine_kwargs(args))
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None


def check_model_path(path: str) -> None:
    """Raise CliError unless ``path`` is a local checkpoint directory."""
    if not is_checkpoint_dir(path):
        raise CliError(not_a_checkpoint("MODEL_PATH", path))


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_tokenizer(path: str) -> None:
    """Raise CliError unless a tokenizer is saved beside the checkpoint (text in, text out)."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        raise CliError(
            f"MODEL_PATH={path!r} is not allowed: it has no tokenizer saved beside it "
            f"(none of {', '.join(_TOKENIZER_FILES)})"
        )
