#!/usr/bin/env bash
# `make test-gpu [PART=k]` on the GPU machine, from the project root: no venv (the image's
# python3 holds torch, transformers, triton, pytest); the wheels of ./.whl (make gpu-wheels, on
# the development machine) go into /tmp/site offline when present; then the GPU tests (marker
# gpu) of part k, or of every part one after another, as tests/gpu_parts.py defines them. Logs,
# JUnit XML and a JSON summary per part land in ${OUT:-evaluation/results}.
# Usage: bash tools/test-gpu.sh [k] [pytest args...]
set -uo pipefail
cd "$(dirname "$0")/.."
source tools/gpu-site.sh || exit 1
export PYTHONUNBUFFERED=1
export HF_PAGED_GIT_SHA=${HF_PAGED_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader 2>/dev/null || true
exec python3 tests/gpu_parts.py run "$@"
