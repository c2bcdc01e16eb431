"""EngineConfig / SamplingParams: an unknown key raises TypeError with the nearest valid key;
seeds must be what torch's generators take."""

from __future__ import annotations

import dataclasses

import pytest

from hf_paged.config import EngineConfig, SamplingParams


@pytest.mark.parametrize(
    "build",
    [
        lambda: EngineConfig(max_num_seq=4),
        lambda: EngineConfig.from_dict({"max_num_seq": 4}),
        lambda: EngineConfig.from_dict(EngineConfig(), max_num_seq=4),
        lambda: dataclasses.replace(EngineConfig(), max_num_seq=4),
    ],
    ids=["constructor", "from_dict", "from_dict_copy", "replace"],
)
def test_engine_config_suggests_nearest_key(build):
    with pytest.raises(TypeError) as info:
        build()
    msg = str(info.value)
    assert "EngineConfig got unknown key(s) ['max_num_seq']" in msg
    assert "max_num_seq -> did you mean max_num_seqs?" in msg
    assert "allowed keys are [" in msg and "'tensor_parallel_size'" in msg


def test_each_unknown_key_gets_its_own_suggestion():
    with pytest.raises(TypeError) as info:
        EngineConfig.from_dict({"tensor_paralel_size": 2, "enable_prefix_cache": True})
    msg = str(info.value)
    assert "tensor_paralel_size -> did you mean tensor_parallel_size?" in msg
    assert "enable_prefix_cache -> did you mean enable_prefix_caching?" in msg


def test_no_suggestion_when_nothing_is_close():
    with pytest.raises(TypeError, match=r"unknown key\(s\) \['zzzz'\]; allowed keys") as info:
        EngineConfig(zzzz=1)
    assert "did you mean" not in str(info.value)


def test_sampling_params_suggests_too():
    with pytest.raises(TypeError, match="temprature -> did you mean temperature?"):
        SamplingParams(temprature=0.0)
    with pytest.raises(TypeError, match="max_token -> did you mean max_tokens?"):
        SamplingParams.from_dict({"max_token": 3})


def test_valid_keys_and_positional_still_work():
    assert EngineConfig(max_num_seqs=3).max_num_seqs == 3
    assert EngineConfig(3).max_num_seqs == 3
    assert SamplingParams(temperature=0.0).greedy
    assert EngineConfig.from_dict({"seed": 5}, max_num_seqs=2) == EngineConfig(
        seed=5, max_num_seqs=2
    )


@pytest.mark.parametrize("seed, n", [(2**64, 1), (2**64 - 1, 2), (-(2**63) - 1, 1)])
def test_sampling_params_refuse_seeds_torch_can_not_take(seed, n):
    """Each completion's generator is seeded ``seed + i``: all must be in torch's range (the
    engine raised 'Overflow when unpacking long long' from a step, the request left behind)."""
    with pytest.raises(ValueError, match=rf"seed={seed} is not allowed: .*\[-2\*\*63, 2\*\*64 - {n}\]"):  # fmt: skip
        SamplingParams(seed=seed, n=n)
    assert SamplingParams(seed=2**64 - n, n=n).seed == 2**64 - n
    with pytest.raises(ValueError, match=r"seed=18446744073709551615 is not allowed"):
        EngineConfig(seed=2**64 - 1)  # the proposers' generator takes seed + 1
