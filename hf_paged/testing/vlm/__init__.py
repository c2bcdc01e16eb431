"""Tiny vision-language models of each served family, and image inputs built by hand.

Each model is built from its family's config (text hidden 64, 2 layers; vision hidden 32, 2
layers; 16x16 images in patches of 4) with weights spread wide (``randomize_``) so that different
images give different text. No tokenizer or processor: ``image`` draws one image's pixel inputs,
``image_tokens`` counts its placeholder tokens the way stock does (the rows its features have),
and ``batch`` lays rows of text ids and images out as a processor would: each image's
placeholder run expanded, rows left padded, the images' tensors collated.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hf_paged.models.vision.stock_tower import cat_padded
from hf_paged.testing.hybrid_configs import HYBRID_TINY
from hf_paged.testing.models import randomize_

IMAGE_TOKEN = 150  # placeholder id of every tiny family; text ids stay below it
PAD = 0
_TEXT = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=128, vocab_size=192, head_dim=16, max_position_embeddings=512,
    pad_token_id=PAD, bos_token_id=1, eos_token_id=2,
)  # fmt: skip
_VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               image_size=16, patch_size=4)  # fmt: skip
_MROPE = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
_QWEN_IDS = dict(
    image_token_id=IMAGE_TOKEN,
    video_token_id=IMAGE_TOKEN + 1,
    vision_start_token_id=IMAGE_TOKEN + 2,
    vision_end_token_id=IMAGE_TOKEN + 3,
)
_QWEN_VISION = dict(depth=2, num_heads=2, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
_PINPOINTS = [[16, 32], [32, 16], [32, 32]]

# family -> (text config keys, vision config keys, top-level keys)
FAMILIES: dict[str, tuple[dict, dict, dict]] = {
    "llava": (_TEXT, _VISION, dict(image_token_id=IMAGE_TOKEN, vision_feature_layer=-1)),
    "llava_next": (_TEXT, _VISION, dict(image_token_id=IMAGE_TOKEN, vision_feature_layer=-1,
                                        image_grid_pinpoints=_PINPOINTS)),
    "llava_onevision": (_TEXT, _VISION, dict(image_token_id=IMAGE_TOKEN, video_token_id=151,
                                             vision_feature_layer=-1,
                                             image_grid_pinpoints=_PINPOINTS)),
    "mistral3": (_TEXT, {**_VISION, "image_size": 32, "head_dim": 16},
                 dict(image_token_id=IMAGE_TOKEN, vision_feature_layer=-1, spatial_merge_size=2)),
    "gemma3": ({**_TEXT, "sliding_window": 8}, _VISION,
               dict(image_token_id=IMAGE_TOKEN, mm_tokens_per_image=4, boi_token_index=151,
                    eoi_token_index=152)),
    "idefics3": (_TEXT, _VISION, dict(image_token_id=IMAGE_TOKEN, scale_factor=2)),
    "smolvlm": (_TEXT, _VISION, dict(image_token_id=IMAGE_TOKEN, scale_factor=2)),
    "llama4": ({**_TEXT, "intermediate_size_mlp": 128, "num_local_experts": 2},
               {**_VISION, "intermediate_size": 128, "vision_output_dim": 32,
                "projector_input_dim": 32, "projector_output_dim": 32,
                "pixel_shuffle_ratio": 0.5}, dict(image_token_id=IMAGE_TOKEN)),
    "qwen2_vl": ({**_TEXT, "rope_parameters": _MROPE},
                 dict(_QWEN_VISION, embed_dim=32, hidden_size=64, mlp_ratio=2), _QWEN_IDS),
    "qwen2_5_vl": ({**_TEXT, "rope_parameters": _MROPE},
                   dict(_QWEN_VISION, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                        window_size=16, fullatt_block_indexes=[1]), _QWEN_IDS),
    "qwen3_vl": ({**_TEXT, "rope_parameters": {**_MROPE, "mrope_interleaved": True}},
                 dict(_QWEN_VISION, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                      num_position_embeddings=64, deepstack_visual_indexes=[0, 1]), _QWEN_IDS),
    # a hybrid decoder (Gated DeltaNet and full attention layers) with M-RoPE over half the dims
    "qwen3_5": ({**_TEXT, **HYBRID_TINY["qwen3_5_text"],
                 "rope_parameters": {**_MROPE, "partial_rotary_factor": 0.5,
                                     "mrope_section": [2, 1, 1], "mrope_interleaved": True}},
                dict(_QWEN_VISION, hidden_size=32, out_hidden_size=64, intermediate_size=64,
                     num_position_embeddings=64), _QWEN_IDS),
}  # fmt: skip


def build_tiny_vlm(family: str, seed: int = 0):
    """A tiny fp32 ``*ForConditionalGeneration`` of ``family`` in eval mode, weights spread."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    text, vision, top = FAMILIES[family]
    config = CONFIG_MAPPING[family](text_config=dict(text), vision_config=dict(vision), **top)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    return randomize_(model, seed).eval()


@dataclass
class Image:
    """One image's inputs as a processor gives them for a batch of one image."""

    tensors: dict[str, torch.Tensor]
    num_tokens: int = 0  # its placeholder tokens (``image_tokens``)


def image(model, seed: int, wide: bool = False) -> Image:
    """One random image for ``model``'s family (``wide``: another size, where sizes vary)."""
    family = model.config.model_type
    g = torch.Generator().manual_seed(seed)
    if family.startswith("qwen"):
        h, w = (4, 6) if wide else (4, 4)  # patches; merged 2x2 into (h*w)/4 tokens
        rows = torch.randn(h * w, 3 * 2 * 4 * 4, generator=g)
        t = {"pixel_values": rows, "image_grid_thw": torch.tensor([[1, h, w]])}
    elif family in ("llava_next", "llava_onevision"):
        from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

        size = (16, 32) if wide else (16, 16)
        n = image_size_to_num_patches(size, model.config.image_grid_pinpoints, 16)
        t = {"pixel_values": torch.randn(1, n, 3, 16, 16, generator=g),
             "image_sizes": torch.tensor([size])}  # fmt: skip
    elif family == "mistral3":
        size = (16, 24) if wide else (16, 16)
        t = {"pixel_values": torch.randn(1, 3, *size, generator=g),
             "image_sizes": torch.tensor([size])}  # fmt: skip
    elif family in ("idefics3", "smolvlm"):
        t = {"pixel_values": torch.randn(1, 1, 3, 16, 16, generator=g),
             "pixel_attention_mask": torch.ones(1, 1, 16, 16, dtype=torch.bool)}  # fmt: skip
    else:
        t = {"pixel_values": torch.randn(1, 3, 16, 16, generator=g)}
    img = Image({k: v.to(model.device) for k, v in t.items()})
    img.num_tokens = image_tokens(model, img)
    return img


@torch.no_grad()
def image_tokens(model, img: Image) -> int:
    """Placeholder tokens of ``img``: the rows stock's ``get_image_features`` gives it."""
    base = getattr(model, "model", model)
    fn = getattr(base, "get_image_features", None) or model.get_image_features
    out = fn(**img.tensors, return_dict=True).pooler_output
    feats = list(out) if not isinstance(out, torch.Tensor) else list(out.unbind(0))
    return sum(f.reshape(-1, f.shape[-1]).shape[0] for f in feats)


def expand(model, row: list) -> list[int]:
    """A row of text ids and ``Image``s as ids: each image as its placeholder run (Qwen: wrapped
    in vision start / end ids, as its processor does)."""
    qwen = model.config.model_type.startswith("qwen")
    ids: list[int] = []
    for part in row:
        if isinstance(part, Image):
            run = [IMAGE_TOKEN] * part.num_tokens
            ids += [IMAGE_TOKEN + 2, *run, IMAGE_TOKEN + 3] if qwen else run
        else:
            ids += list(part)
    return ids


def batch(model, rows: list[list]) -> dict:
    """``generate`` keywords for ``rows`` (text id lists and ``Image``s): left-padded
    ``input_ids`` / ``attention_mask``, the images' tensors collated as the family's processor
    collates them, and the token types Qwen (``mm_token_type_ids``) and Gemma 3
    (``token_type_ids``) take."""
    family = model.config.model_type
    seqs = [expand(model, r) for r in rows]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, device=model.device)
        mask[i, width - len(s) :] = 1
    out = {"input_ids": ids, "attention_mask": mask}
    images = [[p for p in r if isinstance(p, Image)] for r in rows]
    flat = [img for per_row in images for img in per_row]
    if family.startswith("qwen"):
        out["mm_token_type_ids"] = (ids == IMAGE_TOKEN).int()
    if family == "gemma3":
        out["token_type_ids"] = (ids == IMAGE_TOKEN).long()
    if not flat:
        return out
    if family in ("idefics3", "smolvlm"):
        n = max(len(r) for r in images)
        pix = torch.zeros(len(rows), n, 3, 16, 16, device=model.device)
        pam = torch.zeros(len(rows), n, 16, 16, dtype=torch.bool, device=model.device)
        for i, per_row in enumerate(images):
            for j, img in enumerate(per_row):
                pix[i, j] = img.tensors["pixel_values"][0, 0]
                pam[i, j] = img.tensors["pixel_attention_mask"][0, 0]
        out.update(pixel_values=pix, pixel_attention_mask=pam)
        return out
    for key in flat[0].tensors:
        parts = [img.tensors[key] for img in flat]
        out[key] = cat_padded(parts)  # the processor's own batch padding
    return out


def stock_greedy(model, rows: list[list], new_tokens: int) -> list[list[int]]:
    """Stock greedy ``generate`` of each row alone: its new token ids."""
    outs = []
    for r in rows:
        kw = batch(model, [r])
        with torch.no_grad():
            seq = model.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, pad_token_id=PAD)  # fmt: skip
        outs.append(seq[0, kw["input_ids"].shape[1] :].tolist())
    return outs


# an engine small enough for the tests, and one whose prefill chunks (3 tokens) are smaller
# than any tiny image (4 tokens or more)
ENGINE = dict(kv_block_size=4, num_kv_blocks=256, max_model_len=128)
CRAMPED = dict(ENGINE, max_num_batched_tokens=3, max_num_seqs=2)


def paged_greedy(model, rows: list[list], new_tokens: int, config: dict = ENGINE,
                 **kwargs) -> list[list[int]]:  # fmt: skip
    """``generate(backend="paged")`` greedy on ``rows`` (one left-padded batch): each row's new
    tokens. Fails on a fallback to stock."""
    return paged_tokens(model, batch(model, rows), new_tokens, config, **kwargs)


def paged_tokens(model, kw: dict, new_tokens: int, config: dict = ENGINE,
                 **kwargs) -> list[list[int]]:  # fmt: skip
    """``paged_greedy`` on a batch's ``generate`` keywords as given (``batch``'s, or a copy
    without some of them). Fails on a fallback to stock."""
    import warnings

    from hf_paged.testing.parity import fallback_warnings

    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        out = model.generate(**kw, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD, backend="paged",
                             paged_config=config, **kwargs)  # fmt: skip
    msgs = fallback_warnings(records)
    assert not msgs, msgs
    return out[:, kw["input_ids"].shape[1] :].tolist()


def mixed_rows(model, wide: bool = True) -> list[list]:
    """Five rows: three images (the third wide where ``wide``: another size), text of different
    lengths, a text-only row, and row 0's ids with row 1's image (the image reaches the text)."""
    a, b, c = image(model, 1), image(model, 2), image(model, 3, wide=wide)
    return [
        [[5, 6, 7], a, [8, 9]],
        [[10], b, [11, 12, 13, 14, 15, 16]],
        [[20, 21], c, [22]],
        [[30, 31, 32, 33]],
        [[5, 6, 7], b, [8, 9]],
    ]
