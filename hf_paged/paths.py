"""Checkpoint directories: the one error message for a path that is not one (no torch here, so
the command line can use it before anything heavy loads)."""

from __future__ import annotations

import os


def is_checkpoint_dir(path) -> bool:
    return os.path.isfile(os.path.join(os.fspath(path), "config.json"))


def not_a_checkpoint(name: str, path: str, allowed: str = "a local checkpoint directory") -> str:
    """The error for ``name=path`` when ``path`` is no checkpoint directory; a path that looks
    like a hub id (``org/name``, not on disk) gets the command that downloads it."""
    message = (
        f"{name}={path!r} is not allowed: must be {allowed} with a config.json (hf_paged "
        "downloads nothing)"
    )
    if _looks_like_hub_id(path):
        message += (
            f"; {path!r} looks like a Hugging Face Hub id: download it first on a machine that "
            f"reaches the hub, e.g. `huggingface-cli download {path} --local-dir DIR` (or "
            "`huggingface_hub.snapshot_download`), and pass that local directory; for a small "
            "model to try, `hf-paged fetch-demo-model` writes ./models/smollm2-135m-instruct"
        )
    return message


def _looks_like_hub_id(path: str) -> bool:
    """``name`` or ``org/name``, not on disk (``gpt2``, ``Qwen/Qwen3-0.6B``)."""
    parts = path.split("/")
    return (
        not os.path.exists(path)
        and 1 <= len(parts) <= 2
        and all(parts)
        and not path.startswith((".", "~"))
        and "\\" not in path
    )
