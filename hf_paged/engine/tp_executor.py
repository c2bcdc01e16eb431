"""Tensor-parallel executor: rank 0's ModelRunner here, ranks 1..N-1 in spawned workers.

Every step rank 0 broadcasts the ModelInput through shared memory (``ipc.WorkerGroup``), then
runs it itself; the ranks meet in the collectives inside the forward pass (row-parallel
all_reduce, LM-head gather). A worker that dies or raises surfaces here as ``EngineDeadError``.
"""

from __future__ import annotations

import dataclasses

import torch

from hf_paged.distributed.communicator import Communicator
from hf_paged.distributed.process_group import create_process_group, find_free_port
from hf_paged.engine.executor import runner_spec
from hf_paged.engine.ipc import WorkerGroup
from hf_paged.engine.model_runner import ModelRunner, RunnerSpec
from hf_paged.engine.outputs import ModelInput, RunnerOutput
from hf_paged.engine.runtime import RuntimeInfo


def rank_device(device: str, rank: int) -> str:
    """Rank r of an engine on ``cuda:N`` uses ``cuda:N+r``; CPU ranks share the CPU."""
    if device.startswith("cuda"):
        base = int(device.split(":")[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


def build_runner(rank: int, world_size: int, spec: RunnerSpec, address: str, abort_check=None):
    """Process group + ModelRunner for one rank (the WorkerGroup target factory)."""
    device = rank_device(spec.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    spec = dataclasses.replace(spec, device=device)
    pg = create_process_group(
        rank, world_size, address, "cuda" if device.startswith("cuda") else "cpu",
        abort_check=abort_check,
    )  # fmt: skip
    return ModelRunner(spec, rank, Communicator(rank, world_size, pg))


class TPExecutor:
    def __init__(self, runtime: RuntimeInfo, model):
        world = runtime.config.tensor_parallel_size
        if runtime.model_path is None:
            raise ValueError(
                f"tensor_parallel_size={world} needs a checkpoint directory as model (each rank "
                "loads only its shard), not an in-memory model"
            )
        if runtime.device.startswith("cuda"):
            base = int(runtime.device.split(":")[1])
            if base + world > torch.cuda.device_count():
                raise ValueError(
                    f"tensor_parallel_size={world} is not allowed on {runtime.device}: only "
                    f"{torch.cuda.device_count()} CUDA devices"
                )
        spec = runner_spec(runtime, runtime.model_path)
        address = f"127.0.0.1:{find_free_port()}"
        self.group = WorkerGroup(world, build_runner, spec, address)
        try:
            self.runner = build_runner(0, world, spec, address, abort_check=self.group.check)
            self.group.wait_ready()
        except Exception as exc:
            self.group.raise_if_dead(exc)
            self.group.close()
            raise
        if runtime.device.startswith("cuda"):
            self.group.watch_process_group(self.runner.comm.group)
        self.num_kv_blocks = self.runner.num_kv_blocks
        self._closed = False

    def run(self, inp: ModelInput, sampling, external_rows) -> RunnerOutput:
        self.group.check()
        self.group.broadcast("run", inp)
        try:
            return self.runner.run(inp, sampling, external_rows)
        except Exception as exc:
            self.group.raise_if_dead(exc)
            raise

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.group.close()
        finally:
            self.runner.exit()
