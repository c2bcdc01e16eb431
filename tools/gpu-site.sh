# Sourced by the GPU-machine scripts from the project root (tools/test-gpu.sh,
# evaluation/run_gpu_clients.sh, evaluation/run_acceptance_gpu.sh): the wheels of ./.whl
# (make gpu-wheels, on the development machine) go into /tmp/site offline when present, and
# PYTHONPATH points at them and the project. Returns 1 when the install fails.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || return 1
  export PYTHONPATH=/tmp/site:.
else
  echo "no .whl/ (make gpu-wheels): what needs lm-eval, datasets or pytest-xdist skips or runs without them"
  export PYTHONPATH=.
fi
