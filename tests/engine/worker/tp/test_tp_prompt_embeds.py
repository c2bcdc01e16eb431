"""Prompt embeddings under tensor parallelism (gloo, CPU): every rank gets its chunks' rows, so
two ranks give the tokens one rank gives for the same rows (rows that are not the ids'
embeddings, so a rank that embedded the ids instead would differ)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from hf_paged import SamplingParams
from hf_paged.engine.core.prompt_embeds import EmbedRange, PromptEmbeds
from hf_paged.engine.core.request import EngineRequest
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.testing import save_tiny_model
from hf_paged.testing.prompts import make_prompts

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def test_tp2_prompt_embeds_equal_ids(tmp_path):
    path = save_tiny_model("qwen3", str(tmp_path / "m"), seed=3)
    embed = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_input_embeddings()
    prompts = make_prompts([9, 21, 14], seed=6)
    with torch.no_grad():
        g = torch.Generator().manual_seed(0)
        rows = [embed(torch.tensor(p[-6:])) + torch.randn(6, 64, generator=g) for p in prompts]
    got = {}
    for tp in (1, 2):
        cfg = dict(max_model_len=64, kv_block_size=4, num_kv_blocks=64, tensor_parallel_size=tp,
                   max_num_batched_tokens=5)  # fmt: skip
        with LLMEngine(path, cfg) as eng:
            reqs = [EngineRequest(p, PARAMS, prompt_embeds=PromptEmbeds([EmbedRange(len(p) - 6, 6)], r))
                    for p, r in zip(prompts, rows)]  # fmt: skip
            got[tp] = [o.outputs[0].token_ids for o in eng.run(reqs)]
            if tp == 1:
                got["ids"] = [
                    o.outputs[0].token_ids
                    for o in eng.run([EngineRequest(p, PARAMS) for p in prompts])
                ]
    assert got[2] == got[1] != got["ids"]


def test_tp2_vision_language_decoder(tmp_path):
    """A Qwen3-VL checkpoint over two ranks: image rows, M-RoPE positions and DeepStack rows
    reach every rank; the tokens are stock's for each request alone."""
    from hf_paged.integration.multimodal import prompt_embeds
    from hf_paged.testing.vlm import batch, build_tiny_vlm, image, stock_greedy

    model = build_tiny_vlm("qwen3_vl")
    model.save_pretrained(tmp_path / "vlm")
    rows = [[[5, 6, 7], image(model, 1), [8, 9]], [[10], image(model, 2, wide=True), [11, 12]]]
    kw = batch(model, rows)
    ids, mask = kw.pop("input_ids"), kw.pop("attention_mask")
    embeds = prompt_embeds(model, ids, mask, kw)
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6)
    cfg = dict(max_model_len=64, kv_block_size=4, num_kv_blocks=64, tensor_parallel_size=2,
               max_num_batched_tokens=5)  # fmt: skip
    with LLMEngine(str(tmp_path / "vlm"), cfg) as eng:
        reqs = [EngineRequest(i[m.bool()].tolist(), params, prompt_embeds=e)
                for i, m, e in zip(ids, mask, embeds)]  # fmt: skip
        got = [o.outputs[0].token_ids for o in eng.run(reqs)]
    assert got == stock_greedy(model, rows, 6)
