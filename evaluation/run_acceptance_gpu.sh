#!/usr/bin/env bash
# The GPU acceptance runs of issues 29-32 that are still open, as calls of under 10 minutes on one
# H200 (device tool: carry [".whl", ".ab"]; each call's results come back from $OUT as one tar).
# Prepare here, once: `make gpu-wheels` (lm-eval, datasets, pytest-xdist wheels into ./.whl) and
# `mkdir -p .ab/base && git archive 38fe7e1 hf_paged evaluation | tar -x -C .ab/base` (the A/B
# base tree). Then, from the project root on the GPU machine:
#
#   bash evaluation/run_acceptance_gpu.sh tests-a   # make test-gpu parts 5, 2 and 4    (~9 min)
#   bash evaluation/run_acceptance_gpu.sh tests-b   # part 6 (coverage, 4 shards), 1, 3, 7 (~9 min)
#   bash evaluation/run_acceptance_gpu.sh bench     # W1/L1 A/B x3 vs 38fe7e1, FP8 GEMM table
#                                                   # (--write-paths), FP8 W2/L1/logits (~9 min)
#   bash evaluation/run_acceptance_gpu.sh clients   # lm-eval CLI multiple choice and rolling
#                                                   # (full + 8-doc), pipeline client (~9 min)
#   bash evaluation/run_acceptance_gpu.sh rest      # prompt logprobs, engine start, Qwen3.5
#                                                   # hybrid bench, FP8 ct/kv (~9 min)
#   bash evaluation/run_acceptance_gpu.sh lora      # LoRA kernels and decode graphs with slots on
#                                                   # CUDA, the 8B-shape bench (< 8 min)
#   bash evaluation/run_acceptance_gpu.sh vlm       # VLM CUDA parity and the Gemma 3 kernel,
#                                                   # Qwen2.5-VL-7B-shape bench (~9 min)
#
# Every step runs under `timeout` so that a slow one cannot eat the call; a step that times out
# says so in steps.log and the next one runs. Everything lands in $OUT/acceptance_<call>.tar.gz
# (and steps.log beside it): the device tool brings back at most 8 files.
set -uo pipefail
cd "$(dirname "$0")/.."
call=${1:?usage: run_acceptance_gpu.sh tests-a|tests-b|bench|clients|rest|lora|vlm}
out=${OUT:-evaluation/results}
work=$(mktemp -d /tmp/acceptance.XXXX)
res=$work/results
mkdir -p "$res" "$out"
source tools/gpu-site.sh || exit 1
export PYTHONUNBUFFERED=1 OUT=$res
export HF_PAGED_GIT_SHA=${HF_PAGED_GIT_SHA:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
log=$out/steps.log
: >"$log"

step() {  # step SECONDS NAME COMMAND...: run it with a time limit, log its status and wall time
  local limit=$1 name=$2
  shift 2
  local t0=$SECONDS
  echo "== $name (limit ${limit}s)" | tee -a "$log"
  timeout -k 10 "$limit" "$@" >"$res/$name.log" 2>&1
  local rc=$?
  local verdict="rc $rc"
  [ "$rc" = 124 ] && verdict="TIMED OUT"
  echo "   $name: $verdict, $((SECONDS - t0)) s; last line: $(tail -n 1 "$res/$name.log")" |
    tee -a "$log"
}

nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$log"
case $call in
  tests-a)
    step 280 part5 bash tools/test-gpu.sh 5
    step 170 part2 bash tools/test-gpu.sh 2
    step 100 part4 bash tools/test-gpu.sh 4
    ;;
  tests-b)
    step 330 part6 bash tools/test-gpu.sh 6
    step 150 part1 bash tools/test-gpu.sh 1
    step 80 part3 bash tools/test-gpu.sh 3
    step 30 part7 bash tools/test-gpu.sh 7
    ;;
  bench)
    step 270 ab env BASE_SHA=38fe7e1 NEW_SHA="$HF_PAGED_GIT_SHA" BASE_DIR=.ab/base OUT="$res/ab" \
      REPEATS=3 STOCK_REQUESTS=0 STOCK_L1=0 bash evaluation/run_ab.sh
    step 120 fp8_gemm python3 evaluation/bench_fp8_gemm.py --write-paths
    cp hf_paged/kernels/fp8/fp8_paths.json "$res/" 2>/dev/null
    step 150 fp8_w2_l1_logits python3 evaluation/bench_fp8.py --parts w2,l1,logits --repeats 2
    ;;
  clients)
    step 300 lm_eval_mc python3 evaluation/run_lm_eval_cli.py --kinds multiple_choice \
      --repeats 1 --work-dir "$work/mc"
    step 150 lm_eval_rolling python3 evaluation/run_lm_eval_cli.py \
      --kinds loglikelihood_rolling --repeats 1 --work-dir "$work/rolling"
    step 100 pipeline env CLIENTS_SIZE=gpu CLIENTS_RESULTS_DIR="$res" python3 -m pytest -q -rs \
      -m clients tests/clients/test_pipeline_client.py
    ;;
  rest)
    step 150 prompt_logprobs python3 evaluation/bench_prompt_logprobs.py \
      --max-num-batched-tokens 16384
    step 90 engine_start env CLIENTS_SIZE=gpu CLIENTS_RESULTS_DIR="$res" python3 -m pytest -q \
      -rs -m clients tests/clients/test_engine_start.py
    step 180 hybrid python3 evaluation/bench_hybrid.py
    step 100 fp8_ct_kv python3 evaluation/bench_fp8.py --parts ct,kv --repeats 2
    ;;
  lora)
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$log"
    step 180 lora_kernel python3 -m pytest -q -rs -m gpu tests/kernels/test_lora_segmented.py \
      tests/kernels/test_lora_per_token.py tests/models/adapters
    step 270 lora_bench python3 evaluation/bench_lora_gpu.py --requests 96 --stock-requests 0
    ;;
  vlm)
    python3 -c "import torch, transformers, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'triton', triton.__version__)" | tee -a "$log"
    step 150 vlm_parity python3 -m pytest -q -rs -m gpu tests/integration/multimodal \
      tests/kernels -k "bidirectional"
    step 400 vlm_bench python3 evaluation/bench_vlm_gpu.py
    ;;
  *)
    echo "unknown call $call: one of tests-a tests-b bench clients rest lora vlm" >&2
    exit 2
    ;;
esac
cp "$log" "$res/"
tar -czf "$out/acceptance_${call}.tar.gz" -C "$work" results
echo "results: $out/acceptance_${call}.tar.gz" | tee -a "$log"
