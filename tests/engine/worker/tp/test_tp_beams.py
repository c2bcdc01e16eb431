"""Beam-search requests at tensor_parallel_size=2 (gloo, CPU): the copy-on-write block copies
travel in the ModelInput to the worker rank, so forked beams' logits stay the HF model's own on
their tokens, as at tp=1."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM

from hf_paged.config import SamplingParams
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.testing import save_tiny_model

PARAMS = SamplingParams(temperature=0.0, max_tokens=16)
ROUNDS = [[0, 0, 0], [2, 2, 0], [1, 0, 0], [0, 1, 2], [2, 2, 2]]


def test_tp2_forked_beams_compute_the_models_logits(tmp_path):
    path = save_tiny_model("llama", str(tmp_path / "llama"), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    config = dict(tensor_parallel_size=2, max_model_len=32, kv_block_size=4, num_kv_blocks=24)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 256) for _ in range(6)]
    with LLMEngine(path, config) as engine:
        rid = engine.add_request(
            EngineRequest(prompt, PARAMS, external_sampling=True, beam_search=True)
        )
        beams, want = [prompt], {(rid, 0)}
        for parents in [*ROUNDS, None]:
            got = {}
            while not want <= got.keys():
                got.update(engine.step().logits)
            for j, toks in enumerate(beams):
                with torch.no_grad():
                    ref = hf(torch.tensor([toks])).logits[0, -1]
                torch.testing.assert_close(got[(rid, j)], ref, atol=1e-4, rtol=1e-4)
            if parents is None:
                break
            tokens = [rng.randrange(3, 256) for _ in parents]
            engine.provide_beams([rid], [parents], [tokens])
            beams = [beams[p] + [t] for p, t in zip(parents, tokens)]
            want = {(rid, j) for j in range(len(parents))}
        assert engine.stats["num_copied_blocks"] > 0
        engine.abort(rid)
        engine.step()
        assert engine.block_manager.num_free_blocks == engine.runtime.num_kv_blocks
