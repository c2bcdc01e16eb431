#!/usr/bin/env bash
# `make test-gpu [PART=k]` on the GPU machine, from the project root: no venv (the image's
# python3 holds torch, transformers, triton, pytest); the wheels of ./.whl (make gpu-wheels, on
# the development machine) go into /tmp/site offline when present; then the GPU tests (marker
# gpu) of part k, or of every part one after another, as tests/gpu_parts.py defines them. Logs,
# JUnit XML and a JSON summary per part land in ${OUT:-evaluation/results}.
# Usage: bash tools/test-gpu.sh [k] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  echo "test-gpu: no .whl/ (make gpu-wheels): tests that need datasets or lm-eval skip"
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1
export HF_PAGED_GIT_SHA=${HF_PAGED_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
exec python3 tests/gpu_parts.py run "$@"
