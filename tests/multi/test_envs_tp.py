"""Tensor-parallel workers run with rank 0's HF_PAGED_* values (carried in the runner's spec),
not with what their own environment says."""

from __future__ import annotations

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
