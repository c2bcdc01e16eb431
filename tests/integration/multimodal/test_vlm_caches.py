"""The encoder cache and the prefix cache with images: the vision tower runs once per distinct
image (across rows, beams, return sequences and calls), counted in the engine's stats; KV is
shared only between equal images at equal places."""

from __future__ import annotations

import pytest
import torch

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.integration.multimodal.prompt_inputs import tower_of
from hf_paged.testing.vlm import ENGINE, batch, build_tiny_vlm, image, paged_greedy, stock_greedy

NEW = 6


def paged(model, rows):
    return paged_greedy(model, rows, NEW)


@pytest.fixture(scope="module", params=["llava", "qwen3_vl"])
def counted(request):
    """A model whose stock ``get_image_features`` calls and images are counted."""
    model = build_tiny_vlm(request.param)
    tower = tower_of(model)
    real, seen = tower.encode_fn, []

    def encode(**kwargs):
        out = real(**kwargs)
        seen.append(len(out.pooler_output))  # images in this call
        return out

    tower.encode_fn = encode
    yield model, seen
    dispatch.release(model)


def test_same_image_in_8_requests_runs_the_tower_once(counted):
    model, seen = counted
    img, other = image(model, 11), image(model, 12)
    rows = [[[5 + i], img, [40 + i, 41]] for i in range(8)]
    seen.clear()
    assert paged(model, rows) == stock_greedy(model, rows, NEW)
    assert seen == [1]  # one call, one image
    stats = existing_owner(model).engine.stats
    hits = stats["encoder_cache_hits"]
    # a later call with the same image and a new one: only the new one is encoded
    rows2 = [[[9], img, [10]], [[9], other, [10]]]
    assert paged(model, rows2) == stock_greedy(model, rows2, NEW)
    assert seen == [1, 1]
    stats = existing_owner(model).engine.stats
    assert stats["encoder_cache_hits"] == hits + 1
    assert stats["encoder_cache_encoded_images"] == 2
    assert stats["encoder_cache_budget_rows"] == 16384
    assert stats["encoder_cache_rows"] == 2 * img.num_tokens


def test_beams_and_return_sequences_share_the_image(counted):
    model, seen = counted
    rows = [[[5, 6], image(model, 21), [7]], [[8], image(model, 22), [9, 10]]]
    kw = batch(model, rows)
    args = dict(max_new_tokens=NEW, num_beams=3, num_return_sequences=2, do_sample=False,
                pad_token_id=0)  # fmt: skip
    ref = model.generate(**kw, **args)
    seen.clear()
    out = model.generate(**kw, **args, backend="paged", paged_config=ENGINE)
    assert torch.equal(out, ref)
    assert seen == [2]  # two images, once each, for 6 beams and 4 returned rows


def test_prefix_cache_keys_images(counted):
    """The same ids with another image share only the blocks before the image; the same image
    at the same place shares its blocks too."""
    model, _ = counted
    a, b = image(model, 31), image(model, 32)
    text = list(range(3, 11))  # two blocks of 4 before the image
    engine_stats = lambda: existing_owner(model).engine.stats  # noqa: E731
    paged(model, [[text, a, [12, 13]]])
    before = engine_stats()["prefix_cache_hit_tokens"]
    paged(model, [[text, b, [12, 13]]])
    after_other = engine_stats()["prefix_cache_hit_tokens"]
    assert after_other - before == 8
    paged(model, [[text, a, [12, 13]]])
    after_same = engine_stats()["prefix_cache_hit_tokens"]
    assert after_same - after_other >= 8 + 4 * ((a.num_tokens + 2) // 4 - 1)


def test_calls_admitted_together_encode_in_one_batch(counted):
    """``encode_calls``: the images of several calls in one stock batch (shared images once); a
    call with pixels of a wrong shape gets its own error and the others their features."""
    from hf_paged.engine.core.encoder_cache import EncoderCache
    from hf_paged.integration.multimodal import encode_calls, prompt_embeds

    model, seen = counted
    a, b, c = image(model, 41), image(model, 42), image(model, 43)
    calls = [[[[5], a, [6]]], [[[7], b, [8]], [[9], a, [10]]], [[[11], c, [12]]]]
    kws = [batch(model, rows) for rows in calls]
    mm = [{k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")} for kw in kws]
    cache = EncoderCache(1024)
    seen.clear()
    got = encode_calls(model, mm, cache)
    assert seen == [3]  # a, b, c once each, in one call of the tower
    for kw, enc, extra in zip(kws, got, mm):
        embeds = prompt_embeds(model, kw["input_ids"], kw["attention_mask"], extra, cache, enc)
        alone = prompt_embeds(model, kw["input_ids"], kw["attention_mask"], extra)
        for e, ref in zip(embeds, alone):
            assert torch.equal(e.rows, ref.rows) and e.ranges == ref.ranges
    bad = dict(mm[2], pixel_values=mm[2]["pixel_values"][..., :-1])  # one value short
    seen.clear()
    got = encode_calls(model, [mm[0], bad], EncoderCache(1024))
    assert isinstance(got[1], Exception) and not isinstance(got[0], Exception)
    assert torch.equal(got[0][1][0].rows, encode_calls(model, [mm[0]], None)[0][1][0].rows)


def test_new_weights_drop_the_image_features():
    """``update_weights`` (an RL loop's sync) drops the encoder cache with the prefix cache: the
    features were computed by the old vision weights."""
    from hf_paged.engine.llm_engine import LLMEngine
    from hf_paged.integration.multimodal import prompt_embeds

    model = build_tiny_vlm("llava")
    kw = batch(model, [[[5], image(model, 1), [6]]])
    ids, mask = kw.pop("input_ids"), kw.pop("attention_mask")
    with LLMEngine(model, ENGINE) as eng:
        cache = eng.runtime.encoder_cache
        prompt_embeds(model, ids, mask, kw, cache)
        assert len(cache) == 1
        eng.update_weights([])
        assert len(cache) == 0 and cache.stats()["encoder_cache_rows"] == 0
