"""Vision-language models through ``generate(backend="paged")``: the vision tower runs stock, the
decoder runs on the engine with the image features as prompt embeddings.

For each served family (tiny fp32 models from each family's config, pixel inputs built by hand,
placeholder runs expanded by hand), all token-identical to stock greedy on each request alone:
one left-padded batch of requests with different images and text lengths; each request alone,
one after another on one engine (the same ids with another image differ exactly as stock does);
an engine whose prefill chunks are smaller than one image (chunks split images). Gemma 3, whose
image tokens attend bidirectionally, has its own module (test_vlm_gemma3.py)."""

from __future__ import annotations

import pytest
import torch

from hf_paged.integration import dispatch
from hf_paged.integration.engine_owner import existing_owner
from hf_paged.testing.vlm import (
    CRAMPED,
    ENGINE,
    FAMILIES,
    batch,
    build_tiny_vlm,
    expand,
    image,
    mixed_rows,
    paged_greedy,
    stock_greedy,
)

NEW = 6
SERVED = sorted(f for f in FAMILIES if f != "gemma3")


def paged(model, rows, config=ENGINE):
    return paged_greedy(model, rows, NEW, config)


@pytest.fixture(scope="module", params=SERVED)
def vlm(request):
    """(model, rows, stock's tokens of each row alone): three images of two sizes, text of
    different lengths, a text-only row, and row 0's ids with row 1's image."""
    model = build_tiny_vlm(request.param)
    rows = mixed_rows(model)
    yield model, rows, stock_greedy(model, rows, NEW)
    dispatch.release(model)


def test_left_padded_batch(vlm):
    model, rows, stock = vlm
    assert paged(model, rows) == stock


def test_each_alone_on_one_engine(vlm):
    model, rows, stock = vlm
    got = [paged(model, [r])[0] for r in rows]
    engine = existing_owner(model).engine
    assert got == stock
    assert existing_owner(model).engine is engine  # one engine served them all
    assert stock[0] != stock[4]  # same ids, another image: the image reaches the text


def test_prefill_chunks_smaller_than_an_image(vlm):
    model, rows, stock = vlm
    assert min(p.num_tokens for r in rows for p in r if hasattr(p, "num_tokens")) > 3
    assert paged(model, rows, CRAMPED) == stock


def test_preempted_requests_recompute_their_images(vlm):
    """KV for about one request at a time: requests are preempted and recomputed from their
    prompt (image rows and positions included)."""
    model, rows, stock = vlm
    longest = max(len(expand(model, r)) for r in rows) + NEW
    blocks = -(-longest // 4)  # just enough KV for the longest request alone
    assert paged(model, rows, dict(ENGINE, max_model_len=4 * blocks, num_kv_blocks=blocks)) == stock
    assert existing_owner(model).engine.stats["num_preemptions"] > 0


@pytest.mark.parametrize(
    ("model_type", "why"),
    [("idefics2", "has not been checked"), ("lfm2_vl", "has not been checked"),
     ("glm4v", "has not been checked")],
)  # fmt: skip
def test_other_families_are_refused_by_name(model_type, why):
    """Families whose merge has not been checked against stock run stock under a named reason
    (the config alone decides)."""
    from transformers import CONFIG_MAPPING

    from hf_paged.models.generic.support import static_refusal

    reason = static_refusal(CONFIG_MAPPING[model_type]())
    assert reason is not None and why in reason.detail, reason


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_other_decoding_paths(family):
    """Prompt lookup (speculative chunks past the prompt, M-RoPE delta) and the external
    sampling loop (scores returned): stock's tokens and scores."""
    model = build_tiny_vlm(family)
    rows = [[[5, 6, 7, 5, 6, 7], image(model, 1), [8, 9, 5, 6]], [[10], image(model, 2), [11]]]
    stock = stock_greedy(model, rows, 10)
    kw = batch(model, rows)
    width = kw["input_ids"].shape[1]
    args = dict(max_new_tokens=10, min_new_tokens=10, pad_token_id=0)
    lookup = model.generate(**kw, **args, do_sample=False, prompt_lookup_num_tokens=3,
                            backend="paged", paged_config=ENGINE)  # fmt: skip
    assert lookup[:, width:].tolist() == stock
    scored = dict(args, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = model.generate(**kw, **scored)
    out = model.generate(**kw, **scored, backend="paged", paged_config=ENGINE)
    assert torch.equal(out.sequences, ref.sequences)
    for a, b in zip(out.scores, ref.scores, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    dispatch.release(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (marker gpu)")
@pytest.mark.parametrize("family", SERVED)
def test_batch_and_split_images_on_cuda(family):
    """The batch and the image-splitting chunks on a CUDA engine (fp32, the GPU attention
    backend) equal stock on CUDA for each request alone."""
    model = build_tiny_vlm(family).cuda()
    a, b, c = (image(model, s, wide=s == 3) for s in (1, 2, 3))
    rows = [[[5, 6, 7], a, [8, 9]], [[10], b, [11, 12, 13]], [[20, 21], c, [22]], [[30, 31]]]
    stock = stock_greedy(model, rows, NEW)
    cuda = dict(device="cuda", kv_block_size=8)  # the Triton kernels take blocks of 8 and up
    assert paged(model, rows, dict(ENGINE, **cuda)) == stock
    assert paged(model, rows, dict(CRAMPED, **cuda)) == stock
    dispatch.release(model)
