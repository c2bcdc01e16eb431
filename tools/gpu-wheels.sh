#!/usr/bin/env bash
# The wheels the GPU machine lacks, for `make test-gpu` and the client suite (run here, on the
# development machine, where PyPI answers; the GPU machine reaches no registry). Fills the
# git-ignored ./.whl (~14 MB): lm-eval 0.4.13 and datasets with the pure-Python dependencies the
# GPU image does not have (it has torch, transformers, peft, pyarrow, pandas, scikit-learn,
# sacrebleu, jinja2, huggingface-hub, pytest, hypothesis: see /work/.library/device/KINDS.md).
# Usage, from the project root:  make gpu-wheels   (or: bash tools/gpu-wheels.sh [DEST])
# Carry it to the GPU machine with the working tree (device tool: carry [".whl"]); there
# `make test-gpu` / tools/test-gpu.sh install it offline:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#     --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
# The set was checked on the H200 image (Python 3.12): lm_eval 0.4.13 and datasets 5.2.0 import,
# and `python3 -m lm_eval --model hf ... --device cuda` runs a local generate_until task.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${1:-.whl}
mkdir -p "$dest"
pip=(python3 -m pip)
if [ -x .venv/bin/python ]; then pip=(.venv/bin/python -m pip); fi
plat=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
"${pip[@]}" download -q --no-deps --only-binary=:all: "${plat[@]}" -d "$dest" \
  lm-eval==0.4.13 datasets==5.2.0 evaluate pytablewriter DataProperty mbstrdecoder pathvalidate \
  tabledata tcolorpy typepy chardet "dill<0.4.2" "multiprocess<0.70.20" more-itertools nltk \
  pytest-xdist execnet
# two pure-Python dependencies ship only as source: build their wheels here
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
"${pip[@]}" download -q --no-deps --no-binary=:all: -d "$tmp" sqlitedict word2number
"${pip[@]}" wheel -q --no-deps -w "$dest" "$tmp"/*
ls "$dest"
