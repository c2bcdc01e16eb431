"""Tensor-parallel engines over NCCL: a worker killed mid-run surfaces as EngineDeadError
(the watchdog aborts rank 0's NCCL group), and close() leaves no worker process and no
/dev/shm segment behind, after a clean run and after a death."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.engine.worker.tp.workers import EngineDeadError
from hf_paged.testing.procfs import pid_alive, shm_segments
from tests.engine.worker.tp.nccl_models import ENGINE, needs_gpus, prompts, save_model

pytestmark = pytest.mark.multi_gpu
if torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return save_model("llama", str(tmp_path_factory.mktemp("tp_life") / "llama"))


def assert_all_gone(pids: list[int], before: set[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in pids if pid_alive(p)], "orphaned tensor-parallel workers"
    assert shm_segments() <= before, f"left in /dev/shm: {shm_segments() - before}"


@pytest.mark.parametrize("tp", [2, pytest.param(4, marks=needs_gpus(4))])
def test_nccl_close_leaves_nothing(model_path, tp):
    before = shm_segments()
    llm = LLM(model_path, tensor_parallel_size=tp, **ENGINE)
    pids = llm.engine.executor.group.pids
    assert len(pids) == tp - 1 and all(pid_alive(p) for p in pids)
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    assert all(len(o.token_ids) == 8 for o in llm.generate(prompts(4), sp, use_tqdm=False))
    llm.close()
    llm.close()  # twice is fine
    assert_all_gone(pids, before)


def test_nccl_worker_killed_mid_run_raises_engine_dead(model_path):
    before = shm_segments()
    llm = LLM(model_path, tensor_parallel_size=2, **dict(ENGINE, num_kv_blocks=200))
    pids = llm.engine.executor.group.pids
    long = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)  # 100 + 120 < 256
    llm.generate(prompts(2), long, use_tqdm=False)  # warm: the kill lands in a running step
    killer = threading.Timer(0.5, os.kill, (pids[0], signal.SIGKILL))
    killer.start()
    t0 = time.monotonic()
    try:
        with pytest.raises(EngineDeadError) as err:
            for _ in range(500):  # keep generating until the kill lands
                llm.generate(prompts(), long, use_tqdm=False)
        assert time.monotonic() - t0 < 15  # NCCL abort ends the pending collective
        assert err.value.rank == 1 and "exit code" in err.value.detail
        with pytest.raises((EngineDeadError, RuntimeError)):  # the engine stays dead
            llm.generate(prompts(1), long, use_tqdm=False)
    finally:
        killer.cancel()
        llm.close()
    assert_all_gone(pids, before)
