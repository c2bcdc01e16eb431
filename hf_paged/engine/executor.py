"""Executors: how the engine reaches its ModelRunner(s).

``LocalExecutor`` holds rank 0's runner in this process (tensor_parallel_size == 1). The
multi-rank executor adds worker processes (see ``ipc.py``) that mirror every call.
"""

from __future__ import annotations

from hf_paged.engine.model_runner import ModelRunner, RunnerSpec
from hf_paged.engine.outputs import ModelInput, RunnerOutput
from hf_paged.engine.runtime import RuntimeInfo


def runner_spec(runtime: RuntimeInfo, model_source) -> RunnerSpec:
    return RunnerSpec(
        config=runtime.config,
        hf_config=runtime.hf_config,
        model_source=model_source,
        device=runtime.device,
        dtype=runtime.dtype,
        max_model_len=runtime.max_model_len,
    )


class LocalExecutor:
    """World size 1: rank 0's runner lives here and calls are plain method calls."""

    def __init__(self, runtime: RuntimeInfo, model):
        source = runtime.model_path if runtime.model_path is not None else model
        self.runner = ModelRunner(runner_spec(runtime, source))
        self.num_kv_blocks = self.runner.num_kv_blocks

    def run(self, inp: ModelInput, sampling, external_rows) -> RunnerOutput:
        return self.runner.run(inp, sampling, external_rows)

    def run_async(self, inp: ModelInput, sampling, prev, prev_rows):
        return self.runner.run_async(inp, sampling, prev, prev_rows)

    def close(self) -> None:
        self.runner.exit()


def create_executor(runtime: RuntimeInfo, model):
    if runtime.config.tensor_parallel_size == 1:
        return LocalExecutor(runtime, model)
    from hf_paged.engine.tp_executor import TPExecutor

    return TPExecutor(runtime, model)
