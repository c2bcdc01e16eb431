#!/usr/bin/env bash
# Issue 23 on one H200, from the project root of a fresh checkout: the GPU memory tests
# (tests/engine/worker/test_kv_budget_runner.py) and the client suite (tests/clients, CLIENTS_SIZE=gpu: lm-eval
# CLI, pipelines, datasets.map, `hf-paged run` on a script, torchrun shard_generate, engine
# start), each client beside stock in fresh processes. Results: one clients_gpu_<UTC>.json per
# part, and the pytest logs, in $OUT (default evaluation/results).
#
# Prepare here:  make gpu-wheels     (tools/gpu-wheels.sh: fills ./.whl with lm-eval, datasets)
# Then, with the device tool (carry [".whl"]), one part per call (each under 10 minutes):
#   bash evaluation/run_gpu_clients.sh a    # memory tests, engine start, lm-eval generate_until
#                                           # and multiple_choice at --batch_size 16
#   bash evaluation/run_gpu_clients.sh b    # lm-eval loglikelihood_rolling, --batch_size auto
#                                           # on all three tasks, the fp32 runs (strings, loglikelihoods)
#   bash evaluation/run_gpu_clients.sh c    # pipeline, hf-paged run, datasets.map, torchrun
# `all` runs the three in a row (about 20 minutes: more than one call allows). Ray is not on the
# GPU image: its client skips, naming why. Stock runs at the issue's sizes take most of the time
# (generate_until at batch 16: ~140 s).
# Issue 29's breakdown table (stock's phases beside ours, "outside model work" ours - stock <= 1 s):
#   CLIENTS_BREAKDOWN=1 bash evaluation/run_gpu_clients.sh a
# re-runs each pair's stock command under `hf-paged run --timings FILE --backend hf` after the
# pair: stock's time again per client, so select fewer clients per call with -k (the part's
# pytest arguments below); the tables land in the JSON (breakdown_tables) and beside it in
# clients_gpu_<UTC>.breakdown.md. Off (0) by default.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:-all}
out=${OUT:-evaluation/results}
mkdir -p "$out"
source tools/gpu-site.sh || exit 1
export CLIENTS_SIZE=gpu CLIENTS_RESULTS_DIR=$out PYTHONUNBUFFERED=1
export CLIENTS_BREAKDOWN=${CLIENTS_BREAKDOWN:-0}
export HF_PAGED_GIT_SHA=${HF_PAGED_GIT_SHA:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true

suite() {  # name, pytest args...
  local name=$1
  shift
  python3 -m pytest -p no:cacheprovider -rs -q --durations=0 "$@" 2>&1 | tee "$out/pytest_$name.log"
}

case $part in
  a | all)
    suite a_memory -m gpu tests/engine/worker/test_kv_budget_runner.py
    suite a_clients -m clients tests/clients \
      -k "engine_start or (per_task and (generate_until or multiple_choice))" ;;&
  b | all)
    suite b_clients -m clients tests/clients -k "per_task and loglikelihood_rolling or auto or fp32" ;;&
  c | all)
    suite c_clients -m clients tests/clients \
      -k "pipeline or hf_paged_run or datasets_map or torchrun or ray" ;;
  a | b) ;;
  *) echo "usage: $0 a|b|c|all" >&2; exit 2 ;;
esac
ls -la "$out" | tail -n 12
