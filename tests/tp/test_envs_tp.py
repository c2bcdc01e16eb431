"""Tensor-parallel workers run with rank 0's HF_PAGED_* values (carried in the runner's spec),
not with what their own environment says; and with NVLink multicast off unless the user chose."""

from __future__ import annotations

import json
import os

import pytest

from hf_paged import LLM, SamplingParams, envs
from hf_paged.testing import save_tiny_model


def test_workers_use_rank0_switches_not_their_environment(tmp_path, monkeypatch):
    path = save_tiny_model("llama", str(tmp_path / "m"), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    envs.reset()
    try:
        envs.snapshot()  # rank 0 has read every switch
        # the spawned worker inherits this environment: were it to read the switches itself,
        # every bool one would raise ValueError there and the engine would fail to start
        for name, switch in envs.SWITCHES.items():
            if isinstance(switch.default, bool):
                monkeypatch.setenv(name, "not-a-bool")
        engine = dict(max_model_len=64, kv_block_size=8, num_kv_blocks=16)
        with LLM(path, tensor_parallel_size=2, **engine) as llm:
            got = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
        with LLM(path, **engine) as llm:
            ref = llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
        assert got == ref
    finally:
        envs.reset()


def test_worker_environment_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("NCCL_NVLS_ENABLE", raising=False)
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    got = envs.worker_environment()
    assert got["NCCL_NVLS_ENABLE"] == "0"
    assert "TORCH_SYMM_MEM_DISABLE_MULTICAST" not in got  # the user's value wins
    with pytest.raises(ValueError, match="'PATH' is not allowed"):
        envs.set_environment({"PATH": "/nowhere"})


def test_spawned_workers_run_with_nvlink_multicast_off(tmp_path, monkeypatch):
    from hf_paged.engine.worker.tp.workers import WorkerGroup
    from tests.tp.dummy_target import env_probe

    # setenv first so that monkeypatch restores "unset" after WorkerGroup sets it in this process
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "placeholder")
    monkeypatch.delenv("NCCL_NVLS_ENABLE")
    monkeypatch.setenv("NVSHMEM_DISABLE_NVLS", "placeholder")
    monkeypatch.delenv("NVSHMEM_DISABLE_NVLS")
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")  # set by the user: kept
    path = tmp_path / "worker_env.json"
    group = WorkerGroup(2, env_probe, str(path))
    try:
        group.wait_ready()  # as the engine: no deadline while the worker is alive
    finally:
        group.close()
    assert json.loads(path.read_text()) == {
        "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "0",
        "NVSHMEM_DISABLE_NVLS": "1",
    }  # fmt: skip
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"  # rank 0's own NCCL group agrees
