"""The vision-language workload (``evaluation/bench_vlm_gpu.py``): a Qwen2.5-VL model with random
weights, its processor built offline, and the request set.

* Model ``qwen2.5-vl-7b``: Qwen2.5-VL-7B-Instruct's text and vision widths (text hidden 3584, 28
  layers, 28 heads, 4 KV heads, intermediate 18944, vocab 152064; vision depth 32, hidden 1280,
  patch 14, merge 2, windowed attention with full layers 7/15/23/31), random weights in the
  given dtype. ``tiny``: the same family at hidden 64 / 2 layers for CPU smoke runs.
* Processor: stock ``Qwen2_5_VLProcessor`` over the PIL image processor (no torchvision needed)
  and a character-level tokenizer built with ``tokenizers``, whose ids 151643-151656 are Qwen's
  special tokens (``<|vision_start|>``, ``<|image_pad|>``, ``<|vision_end|>``, ...). A 448x448
  image is 32x32 patches, merged 2x2 into 256 placeholder tokens.
* Requests (``vlm_requests``): one image each (448x448 random colour blocks; a quarter of the
  requests reuse an earlier request's image), text of U[50, 300] characters (one token each),
  outputs of U[50, 300] tokens, ``random.Random(seed)``; EOS ignored, greedy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

IMAGE_PAD = 151655
_SPECIAL = {
    151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
    151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
    151655: "<|image_pad|>", 151656: "<|video_pad|>",
}  # fmt: skip
PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"

_SHAPES = {
    "qwen2.5-vl-7b": dict(
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                  num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                  max_position_embeddings=32768, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24],
                                   "rope_theta": 1000000.0}),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                    out_hidden_size=3584, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[7, 15, 23, 31]),
    ),
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=152064,
                  max_position_embeddings=4096,
                  rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                   "rope_theta": 10000.0}),
        vision=dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2,
                    out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                    temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1]),
    ),
}  # fmt: skip


def build_model(arch: str, dtype: torch.dtype, device) -> torch.nn.Module:
    """``Qwen2_5_VLForConditionalGeneration`` of ``arch``'s shape with random weights, built on
    ``device`` in ``dtype`` (eval mode; no EOS, pad id 0: stock never stops early)."""
    from transformers import AutoModelForImageTextToText, Qwen2_5_VLConfig

    shape = _SHAPES[arch]
    config = Qwen2_5_VLConfig(
        text_config=dict(shape["text"], eos_token_id=None, bos_token_id=None, pad_token_id=0),
        vision_config=dict(shape["vision"]),
        image_token_id=IMAGE_PAD, video_token_id=151656,
        vision_start_token_id=151652, vision_end_token_id=151653,
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForImageTextToText.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def build_processor(image_size: int = 448):
    """Stock ``Qwen2_5_VLProcessor`` with a character-level tokenizer (see the module doc)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    vocab = {"<pad>": 0, "<unk>": 1}
    for c in range(32, 127):
        vocab[chr(c)] = len(vocab)
    for i, t in _SPECIAL.items():
        vocab[t] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in _SPECIAL.values()])  # fmt: skip
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", padding_side="left",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_start_token": "<|vision_start|>",
                              "vision_end_token": "<|vision_end|>"},
    )  # fmt: skip
    pixels = image_size * image_size
    images = Qwen2VLImageProcessorPil(min_pixels=pixels, max_pixels=pixels)
    video = None
    try:  # stock's video processor needs torchvision; the image requests here need none
        from transformers import Qwen2VLVideoProcessor

        video = Qwen2VLVideoProcessor()
    except Exception:  # noqa: BLE001 - ImportError or transformers' torchvision requirement
        pass
    if video is not None:
        return Qwen2_5_VLProcessor(image_processor=images, tokenizer=tokenizer,
                                   video_processor=video)  # fmt: skip
    return _ImageOnlyProcessor(image_processor=images, tokenizer=tokenizer)


def _image_only_class():
    from transformers import Qwen2_5_VLProcessor

    class ImageOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
        """Stock's processor without its video half (which needs torchvision)."""

        @classmethod
        def get_attributes(cls):
            return ["image_processor", "tokenizer"]

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            self.video_processor = None
            super(Qwen2_5_VLProcessor, self).__init__(
                image_processor, tokenizer, chat_template=chat_template
            )

    return ImageOnlyQwen2_5_VLProcessor


def _ImageOnlyProcessor(**kwargs):  # noqa: N802 - a class made on first use
    return _image_only_class()(**kwargs)


@dataclass(frozen=True)
class VlmRequest:
    text: str  # the prompt text: the image placeholder, then the question's characters
    image_index: int  # into ``images``
    output_len: int


def vlm_requests(n: int, image_size: int = 448, seed: int = 0):
    """``(requests, images)``: ``n`` requests, each with one image; a quarter of them reuse an
    earlier request's image (module doc)."""
    from PIL import Image

    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    images, reqs = [], []
    letters = "abcdefghijklmnopqrstuvwxyz "
    for i in range(n):
        if i >= 4 and rng.random() < 0.25:
            index = rng.randrange(len(images))
        else:
            blocks = torch.randint(0, 256, (8, 8, 3), generator=g, dtype=torch.uint8)
            up = image_size // 8
            pix = blocks.repeat_interleave(up, 0).repeat_interleave(up, 1)
            images.append(Image.fromarray(pix.numpy(), "RGB"))
            index = len(images) - 1
        text = "".join(rng.choice(letters) for _ in range(rng.randint(50, 300)))
        reqs.append(VlmRequest(PLACEHOLDER + text, index, 0))
    out_lens = [rng.randint(50, 300) for _ in range(n)]
    reqs = [VlmRequest(r.text, r.image_index, m) for r, m in zip(reqs, out_lens, strict=True)]
    return reqs, images
