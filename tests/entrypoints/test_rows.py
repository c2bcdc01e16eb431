"""The pieces map_generate and shard_generate share: row seeds, GenerationConfig mapping,
prompt cells, and the GPU a launcher rank's engine takes."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import GenerationConfig

from hf_paged import SamplingParams
from hf_paged.entrypoints.rows import as_prompt, resolve_sampling, row_params, row_seed
from hf_paged.entrypoints.torchrun import local_device


def test_row_seed_is_stable_and_distinct():
    assert row_seed(0, 5) == row_seed(0, np.int64(5))  # NumPy and Python ints hash alike
    assert row_seed(0, 5) != row_seed(1, 5)
    assert row_seed(0, 5) != row_seed(0, "5")  # an int id and its text are different rows
    seeds = {row_seed(3, i) for i in range(1000)}
    assert len(seeds) == 1000 and all(0 <= s < 2**62 for s in seeds)
    with pytest.raises(TypeError, match="row id 1.5"):
        row_seed(0, 1.5)


def test_row_params_seed_only_when_sampling():
    greedy = SamplingParams(temperature=0.0)
    assert [p.seed for p in row_params(greedy, 0, [1, 2])] == [None, None]
    sampled = row_params(SamplingParams(temperature=0.7), 9, [1, 2])
    assert [p.seed for p in sampled] == [row_seed(9, 1), row_seed(9, 2)]


def test_generation_config_maps_to_sampling_params():
    gen = GenerationConfig(do_sample=True, temperature=0.7, top_p=0.9, max_new_tokens=12,
                           min_new_tokens=2, eos_token_id=[2, 5], repetition_penalty=1.1)  # fmt: skip
    sp = resolve_sampling(generation_config=gen)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.max_tokens, sp.min_tokens) == (
        0.7, 50, 0.9, 12, 2,  # top_k unset: stock's default of 50 when sampling
    )  # fmt: skip
    assert sp.stop_token_ids == (2, 5) and sp.ignore_eos and sp.repetition_penalty == 1.1
    greedy = resolve_sampling(generation_config={"max_new_tokens": 4, "num_beams": 1})
    assert greedy.greedy and greedy.max_tokens == 4 and not greedy.ignore_eos
    with pytest.raises(ValueError, match=r"\['num_beams'\]"):
        resolve_sampling(generation_config={"max_new_tokens": 4, "num_beams": 3})
    with pytest.raises(ValueError, match="max_new_tokens=None"):
        resolve_sampling(generation_config=GenerationConfig(max_length=30))
    with pytest.raises(ValueError, match="both set"):
        resolve_sampling(SamplingParams(), {"max_new_tokens": 4})
    with pytest.raises(ValueError, match="n=2"):
        resolve_sampling(SamplingParams(n=2))


def test_prompt_cells():
    assert as_prompt("hi", "prompt") == "hi"
    assert as_prompt(np.array([3, 4]), "prompt") == [3, 4]
    with pytest.raises(TypeError, match="column 'prompt' holds 3.5"):
        as_prompt(3.5, "prompt")


def test_local_device_gives_each_launcher_rank_its_own_gpus():
    assert local_device("1", 2, 8) == "cuda:2"  # rank 1 of tp=2 engines: GPUs 2 and 3
    assert local_device("3", 2, 8) == "cuda:6"
    assert local_device("0", 1, 1) == "cuda:0"
    assert local_device(None, 2, 8) is None  # no launcher
    assert local_device("1", 1, 0) is None  # no CUDA: the engine picks the CPU
    assert local_device("1", 2, 2) is None  # CUDA_VISIBLE_DEVICES already narrowed per rank
