"""Executors: how the engine reaches its ModelRunner(s).

``LocalExecutor`` holds rank 0's runner in this process (tensor_parallel_size == 1). The
multi-rank executor adds worker processes (see ``tp/workers.py``) that mirror every call.
"""

from __future__ import annotations

import torch

from hf_paged.engine.core.contracts import ModelInput
from hf_paged.engine.runtime import RuntimeInfo
from hf_paged.engine.worker.model_runner import ModelRunner
from hf_paged.engine.worker.runner_output import RunnerOutput
from hf_paged.engine.worker.runner_spec import RunnerSpec
from hf_paged.timing import spans


class LocalExecutor:
    """World size 1: rank 0's runner lives here and calls are plain method calls."""

    def __init__(self, runtime: RuntimeInfo, model):
        source = runtime.model_path if runtime.model_path is not None else model
        self.runner = ModelRunner(RunnerSpec.from_runtime(runtime, source))
        self.num_kv_blocks = self.runner.num_kv_blocks

    def run(self, inp: ModelInput, sampling, external_rows) -> RunnerOutput:
        return self.runner.run(inp, sampling, external_rows)

    def run_async(self, inp: ModelInput, sampling, prev, prev_rows):
        return self.runner.run_async(inp, sampling, prev, prev_rows)

    def refresh_weights(self, weights: list) -> int:
        self.runner.refresh_weights(weights, dry_run=True)  # a bad pair changes nothing
        return self.runner.refresh_weights(weights)

    def close(self) -> None:
        self.runner.exit()


def create_executor(runtime: RuntimeInfo, model):
    """The engine's executor, its runner(s) built (timed as ``engine_start``, see timing/spans.py).

    Built outside inference mode whatever the caller's mode: a parameter made an inference
    tensor and then given a shared HF weight (``param.data = ...``) fails in every later
    forward, and the engine outlives the caller's ``torch.inference_mode()`` block."""
    with spans.span("engine_start"), torch.inference_mode(False):
        if runtime.config.tensor_parallel_size == 1:
            return LocalExecutor(runtime, model)
        from hf_paged.engine.worker.tp.executor import TPExecutor

        return TPExecutor(runtime, model)
