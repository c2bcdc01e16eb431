#!/usr/bin/env bash
# A/B of two trees in one GPU call: BASE_DIR (a copy of an older commit's hf_paged/ and
# evaluation/, e.g. `git archive a90c5f5 hf_paged evaluation | tar -x -C .ab/base`) and this
# checkout. W1 (LLM on all 256 requests) and L1 (LLM decode) for each, base and new alternating
# $REPEATS times (default 1), each in a fresh process with nothing run before it in that process;
# then stock baselines in processes of their own (W1: `generate` on the first $STOCK_REQUESTS
# requests, 0 skips it; L1: static cache + compile, STOCK_L1=0 skips it).
# Usage: BASE_SHA=a90c5f5 NEW_SHA=$(git rev-parse --short HEAD) BASE_DIR=.ab/base OUT=/tmp/ab \
#   REPEATS=3 STOCK_REQUESTS=0 bash evaluation/run_ab.sh
set -uo pipefail
base_dir=${BASE_DIR:-.ab/base}
out=${OUT:-/tmp/ab}
stock=${STOCK_REQUESTS:-16}
repeats=${REPEATS:-1}
root=$(pwd)
run() {  # side dir sha args...
  local side=$1 dir=$2 sha=$3; shift 3
  (cd "$dir" && PYTHONUNBUFFERED=1 PYTHONPATH=. HF_PAGED_GIT_SHA=$sha python3 "$@" \
     --out-dir "$out/$side") || echo "FAILED: $side $*"
}
mkdir -p "$out/base" "$out/new"
# ours first, alternating base and new, each in a fresh process with nothing before it
for _ in $(seq "$repeats"); do
  run base "$base_dir" "${BASE_SHA:-base}" evaluation/bench_throughput.py --workload W1 \
    --systems llm --no-llm-subset
  run new "$root" "${NEW_SHA:-new}" evaluation/bench_throughput.py --workload W1 \
    --systems llm --no-llm-subset
done
for _ in $(seq "$repeats"); do
  run base "$base_dir" "${BASE_SHA:-base}" evaluation/bench_latency.py --systems llm
  run new "$root" "${NEW_SHA:-new}" evaluation/bench_latency.py --systems llm --skip-dynamic
done
# then the stock baselines, in processes of their own (STOCK_REQUESTS=0 / STOCK_L1=0 skip them)
if [ "$stock" -gt 0 ]; then
  run new "$root" "${NEW_SHA:-new}" evaluation/bench_throughput.py --workload W1 \
    --systems stock --baseline-requests "$stock"
fi
if [ "${STOCK_L1:-1}" != 0 ]; then
  run new "$root" "${NEW_SHA:-new}" evaluation/bench_latency.py --systems static --skip-dynamic
fi
