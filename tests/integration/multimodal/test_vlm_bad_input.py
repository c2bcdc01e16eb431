"""Bad image inputs get stock's error through ``generate(backend="paged")``, and nothing is lost:
the engine serves the next call as before. On the engine, a bad request raises at
``add_request`` and the requests in flight finish as they would have."""

from __future__ import annotations

import warnings

import pytest
import torch

from hf_paged import SamplingParams
from hf_paged.engine.core.prompt_embeds import EmbedRange, PromptEmbeds
from hf_paged.engine.core.request import EngineRequest
from hf_paged.integration import dispatch
from hf_paged.integration.multimodal import prompt_embeds
from hf_paged.testing import build_hf_model
from hf_paged.testing.parity import fallback_warnings
from hf_paged.testing.vlm import (
    ENGINE,
    IMAGE_TOKEN,
    batch,
    build_tiny_vlm,
    image,
    paged_greedy,
    stock_greedy,
)

NEW = 6
ARGS = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=0)


def paged(model, rows):
    return paged_greedy(model, rows, NEW)


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "idefics3"])
def vlm(request):
    model = build_tiny_vlm(request.param)
    yield model
    dispatch.release(model)


def _both_raise(model, kw) -> None:
    """Stock and paged raise the same error type with the same message, and the paged call
    runs no stock fallback."""
    with pytest.raises(Exception) as stock:
        model.generate(**kw, **ARGS)
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with pytest.raises(type(stock.value)) as ours:
            model.generate(**kw, **ARGS, backend="paged", paged_config=ENGINE)
    assert str(ours.value) == str(stock.value)
    assert not fallback_warnings(records)


def _still_serves(model) -> None:
    rows = [[[5, 6], image(model, 7), [8]], [[9, 10, 11]]]
    assert paged(model, rows) == stock_greedy(model, rows, NEW)


def test_images_without_placeholders(vlm):
    kw = batch(vlm, [[[5, 6], image(vlm, 1), [7]]])
    kw["input_ids"][kw["input_ids"] == IMAGE_TOKEN] = 9  # the run is gone, the pixels are not
    kw.pop("mm_token_type_ids", None)
    _both_raise(vlm, kw)
    _still_serves(vlm)


def test_wrong_number_of_images_for_the_rows(vlm):
    rows = [[[5, 6], image(vlm, 1), [7]], [[8], image(vlm, 2), [9]]]
    kw = batch(vlm, rows)
    one = batch(vlm, [rows[0], [[8, 9]]])  # the second row lost its image's run
    kw["input_ids"], kw["attention_mask"] = _pad_to(one, kw["input_ids"].shape[1])
    if "mm_token_type_ids" in kw:
        kw["mm_token_type_ids"] = (kw["input_ids"] == IMAGE_TOKEN).int()
    _both_raise(vlm, kw)
    _still_serves(vlm)


def _pad_to(kw, width):
    ids, mask = kw["input_ids"], kw["attention_mask"]
    pad = width - ids.shape[1]
    z = torch.zeros(ids.shape[0], pad, dtype=ids.dtype)
    return torch.cat([z, ids], 1), torch.cat([z, mask], 1)


def test_placeholders_without_images_run_as_stock(vlm):
    """No pixels: stock embeds the placeholder ids as text; so does the engine."""
    kw = batch(vlm, [[[5, 6], image(vlm, 1), [7]]])
    kw = {k: kw[k] for k in ("input_ids", "attention_mask")}
    ref = vlm.generate(**kw, **ARGS)
    assert torch.equal(vlm.generate(**kw, **ARGS, backend="paged", paged_config=ENGINE), ref)


def test_pixels_of_a_wrong_shape(vlm):
    kw = batch(vlm, [[[5, 6], image(vlm, 1), [7]]])
    px = kw["pixel_values"]
    kw["pixel_values"] = px[..., :-1] if px.dim() > 2 else px[:, :-1]  # one value short
    _both_raise(vlm, kw)
    _still_serves(vlm)


def test_an_image_for_a_text_only_model():
    model = build_hf_model("llama", 0)
    ids = torch.tensor([[5, 6, 7]])
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
              pixel_values=torch.randn(1, 3, 16, 16))  # fmt: skip
    _both_raise(model, kw)
    dispatch.release(model)


def test_a_bad_request_leaves_the_others_in_flight():
    from hf_paged.engine.llm_engine import LLMEngine

    model = build_tiny_vlm("qwen2_vl")
    rows = [[[5, 6], image(model, 1), [7]], [[8], image(model, 2), [9, 10]]]
    kw = batch(model, rows)
    ids, mask = kw.pop("input_ids"), kw.pop("attention_mask")
    params = SamplingParams(temperature=0.0, max_tokens=NEW, min_tokens=NEW)
    with LLMEngine(model, dict(ENGINE, max_num_batched_tokens=3)) as eng:
        embeds = prompt_embeds(model, ids, mask, kw, eng.runtime.encoder_cache)
        prompts = [i[m.bool()].tolist() for i, m in zip(ids, mask)]
        with eng.request_group() as group:
            rids = [group.add(EngineRequest(p, params, prompt_embeds=e))
                    for p, e in zip(prompts, embeds)]  # fmt: skip
            group.step()
            group.step()  # both mid-prefill now
            bad = PromptEmbeds([EmbedRange(0, 2)], torch.zeros(2, 63))  # wrong hidden size
            with pytest.raises(ValueError, match="prompt_embeds.rows"):
                group.add(EngineRequest(prompts[0], params, prompt_embeds=bad))
            group.drain()
        got = [group.outputs[r].outputs[0].token_ids for r in rids]
    assert got == stock_greedy(model, rows, NEW)
