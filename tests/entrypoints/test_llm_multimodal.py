"""``LLM.generate`` with vLLM's multimodal prompt ``{"prompt": ..., "multi_modal_data":
{"image": ...}}``: the tokens of stock ``generate`` on the processor's inputs, each prompt alone
(tiny Gemma 3, a loaded model with its processor and a checkpoint directory); bad prompts named."""

from __future__ import annotations

import pytest
import torch

from hf_paged import LLM, SamplingParams
from hf_paged.testing.vlm.frontends import build_gemma3, build_processor, make_images, save_gemma3

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ENGINE = dict(kv_block_size=4, max_model_len=128)


def _prompts(n=4):
    images = make_images(n + 1, seed=7)
    out = [{"prompt": f"q{i} <start_of_image> {'ab' * i}", "multi_modal_data": {"image": im}}
           for i, im in enumerate(images[:n])]  # fmt: skip
    # two images in one prompt, as a list
    out.append({"prompt": "x <start_of_image> y <start_of_image> z",
                "multi_modal_data": {"image": [images[n], images[0]]}})  # fmt: skip
    return out


def _stock(model, processor, prompts) -> list[list[int]]:
    outs = []
    for p in prompts:
        images = p["multi_modal_data"]["image"]
        images = images if isinstance(images, list) else [images]
        kw = processor(text=[p["prompt"]], images=[images], return_tensors="pt")
        with torch.no_grad():
            seq = model.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
        outs.append(seq[0, kw["input_ids"].shape[1] :].tolist())
    return outs


@pytest.fixture(scope="module")
def gemma3():
    model = build_gemma3()
    processor = build_processor(model)
    return model, processor, _stock(model, processor, _prompts())


def test_loaded_model_with_its_processor(gemma3):
    model, processor, want = gemma3
    with LLM(model, processor=processor, **ENGINE) as llm:
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        assert outs[0].prompt == _prompts()[0]["prompt"]
        # again: the images' features come from the encoder cache
        again = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in again] == want
    assert want[0] != want[1]


@pytest.mark.gpu
def test_a_model_on_cuda_takes_the_processors_cpu_tensors(gemma3):
    """The processor's tensors come back on the CPU; the engine moves them where the model is
    (a model on CUDA raised a device mismatch in the vision tower)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import copy

    model, processor, want = gemma3
    cuda = copy.deepcopy(model).to("cuda")
    with LLM(cuda, processor=processor, **dict(ENGINE, kv_block_size=8)) as llm:
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_checkpoint_directory(gemma3, tmp_path):
    _, _, want = gemma3
    with LLM(save_gemma3(tmp_path), **ENGINE) as llm:
        outs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outs] == want
        # text prompts still work beside multimodal ones
        mixed = llm.generate(["hello", _prompts()[1]], GREEDY, use_tqdm=False)
        assert list(mixed[1].outputs[0].token_ids) == want[1]


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ({"prompt": "a", "multi_modal_data": {"video": 1}}, "other modalities are not served"),
        ({"prompt": "a", "multi_modal_data": {"image": []}}, "at least one image"),
        ({"prompt_token_ids": [5], "multi_modal_data": {"image": 1}}, "a multimodal prompt is"),
    ],
)
def test_bad_multimodal_prompts_are_named(gemma3, prompt, match):
    model, processor, _ = gemma3
    with LLM(model, processor=processor, **ENGINE) as llm:
        with pytest.raises(ValueError, match=match):
            llm.generate([prompt], GREEDY, use_tqdm=False)
        # a placeholder without its image: the processor's own error, and the engine serves on
        with pytest.raises(ValueError):
            llm.generate([{"prompt": "a", "multi_modal_data": {"image": make_images(1)[0]}}],
                         GREEDY, use_tqdm=False)  # fmt: skip
        assert len(llm.generate(_prompts(1), GREEDY, use_tqdm=False)) == 2
