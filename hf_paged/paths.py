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
    parts = path.split("/")
    if len(parts) == 2 and all(parts) and not os.path.exists(path):
        message += (
            f"; {path!r} looks like a Hugging Face Hub id: download it first, e.g. "
            f"`huggingface-cli download {path} --local-dir DIR` (or "
            "`huggingface_hub.snapshot_download`), and pass that local directory"
        )
    return message
