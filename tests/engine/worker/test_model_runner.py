"""The runner's spec records every HF_PAGED_* switch (hf_paged/envs.py), and a runner runs with
the values its spec records, whatever its own process read (that is how TP workers get rank 0's
values: tests/tp/test_envs_tp.py)."""

from __future__ import annotations

import dataclasses

import pytest

from hf_paged import LLM, envs
from hf_paged.engine.worker.model_runner import ModelRunner
from hf_paged.testing import save_tiny_model

ENGINE = dict(max_model_len=64, kv_block_size=8, num_kv_blocks=16)


@pytest.fixture(autouse=True)
def fresh_envs():
    envs.reset()
    yield
    envs.reset()


def test_spec_records_switches_and_runner_applies_them(tmp_path, monkeypatch):
    path = save_tiny_model("llama", str(tmp_path / "m"))
    monkeypatch.setattr(envs, "HF_PAGED_FUSED", False)  # as if HF_PAGED_FUSED=0 had been read
    with LLM(path, **ENGINE) as llm:
        spec = llm.engine.executor.runner.spec
        assert spec.envs == envs.snapshot()
        assert spec.envs["HF_PAGED_FUSED"] is False and spec.envs["HF_PAGED_PROFILE"] is False
        assert "'HF_PAGED_FUSED': False" in repr(spec)

        # a spec made elsewhere (another process's snapshot) wins over this process's values
        other = dataclasses.replace(
            spec, model_source=path, envs={**spec.envs, "HF_PAGED_PROFILE": True}
        )
        runner = ModelRunner(other)
        try:
            assert envs.HF_PAGED_PROFILE is True
            assert runner.profile.enabled  # read after the spec's values were applied
        finally:
            runner.exit()
