#!/usr/bin/env bash
# A/B of two trees in one GPU call: BASE_DIR (a copy of an older commit's hf_paged/ and
# evaluation/, e.g. `git archive a90c5f5 hf_paged evaluation | tar -x -C .ab/base`) and this
# checkout. W1 (LLM on all 256 requests) and L1 (LLM decode) for each, base first; the new side
# also runs stock baselines (W1: `generate` on the first $STOCK_REQUESTS requests; L1: static
# cache + compile). Usage: BASE_SHA=a90c5f5 NEW_SHA=$(git rev-parse --short HEAD) \
#   BASE_DIR=.ab/base OUT=/tmp/ab bash evaluation/run_ab.sh
set -uo pipefail
base_dir=${BASE_DIR:-.ab/base}
out=${OUT:-/tmp/ab}
stock=${STOCK_REQUESTS:-16}
root=$(pwd)
run() {  # side dir sha args...
  local side=$1 dir=$2 sha=$3; shift 3
  (cd "$dir" && PYTHONUNBUFFERED=1 PYTHONPATH=. HF_PAGED_GIT_SHA=$sha python3 "$@" \
     --out-dir "$out/$side") || echo "FAILED: $side $*"
}
mkdir -p "$out/base" "$out/new"
run base "$base_dir" "${BASE_SHA:-base}" evaluation/bench_throughput.py --workload W1 \
  --systems llm --no-llm-subset
run new "$root" "${NEW_SHA:-new}" evaluation/bench_throughput.py --workload W1 \
  --systems stock llm --baseline-requests "$stock" --no-llm-subset
run base "$base_dir" "${BASE_SHA:-base}" evaluation/bench_latency.py --systems llm
run new "$root" "${NEW_SHA:-new}" evaluation/bench_latency.py --systems llm static
