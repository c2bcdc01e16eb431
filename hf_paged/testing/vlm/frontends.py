"""A tiny Gemma 3 vision-language model with a processor built offline, for the front ends
(``pipeline("image-text-to-text")``, lm-eval's ``hf-multimodal``, ``LLM``): everything a
checkpoint directory holds, made here without the hub.

The processor is stock's ``Gemma3Processor``: a ``Gemma3ImageProcessor`` from its defaults at the
tiny vision tower's 16x16 size, and a character-level tokenizer built with ``tokenizers`` whose
ids 150-152 are the image, begin-of-image and end-of-image tokens of ``testing/vlm.py``'s tiny
family. The model's embeddings and norms are scaled so that images and the bidirectional image
mask change its text (Gemma multiplies embeddings by sqrt(hidden)).
"""

from __future__ import annotations

import os

import torch

IMAGE_SIZE = 16
VOCAB = 192
IMAGE_TOKEN, BOI_TOKEN, EOI_TOKEN, NEWLINE = 150, 151, 152, 153
_SPECIAL = {IMAGE_TOKEN: "<image_soft_token>", BOI_TOKEN: "<start_of_image>",
            EOI_TOKEN: "<end_of_image>"}  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)


def build_gemma3(seed: int = 0):
    """The tiny ``Gemma3ForConditionalGeneration`` (fp32, eval) with spread weights."""
    from hf_paged.testing.vlm import build_tiny_vlm

    model = build_tiny_vlm("gemma3", seed)
    g = torch.Generator().manual_seed(seed + 5)
    with torch.no_grad():
        lm = model.model.language_model
        lm.embed_tokens.weight.mul_(0.02)
        for name, p in lm.named_parameters():
            if "norm" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = 2
    return model


def build_tokenizer():
    """Character-level fast tokenizer (ids: 0 pad, 1 bos, 2 eos, 3 unk, printable ASCII from 4,
    fillers up to ``VOCAB``) with Gemma 3's image tokens at 150-152 and a newline at 153."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["<pad>", "<s>", "</s>", "<unk>"] + [chr(c) for c in range(32, 127)]
    tokens += [f"<x{i}>" for i in range(VOCAB - len(tokens))]
    for i, t in _SPECIAL.items():
        tokens[i] = t
    tokens[NEWLINE] = "\n"  # the processor wraps each image in blank lines
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in _SPECIAL.values()])  # fmt: skip
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", padding_side="left", chat_template=CHAT_TEMPLATE,
        extra_special_tokens={"image_token": _SPECIAL[IMAGE_TOKEN],
                              "boi_token": _SPECIAL[BOI_TOKEN], "eoi_token": _SPECIAL[EOI_TOKEN]},
    )  # fmt: skip


def build_processor(model=None):
    """Stock ``Gemma3Processor`` for the tiny model (``mm_tokens_per_image`` from its config)."""
    from transformers import Gemma3ImageProcessor, Gemma3Processor

    per_image = 4 if model is None else model.config.mm_tokens_per_image
    images = Gemma3ImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    return Gemma3Processor(images, build_tokenizer(), chat_template=CHAT_TEMPLATE,
                           image_seq_length=per_image)  # fmt: skip


def save_gemma3(path: str | os.PathLike, seed: int = 0) -> str:
    """The tiny model and its processor saved in ``path`` (safetensors); returns ``path``."""
    model = build_gemma3(seed)
    model.save_pretrained(path)
    build_processor(model).save_pretrained(path)
    return os.fspath(path)


def make_images(n: int, seed: int = 0) -> list:
    """``n`` distinct RGB PIL images of ``IMAGE_SIZE`` pixels: random colour blocks."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        blocks = torch.randint(0, 256, (4, 4, 3), generator=g, dtype=torch.uint8)
        pixels = blocks.repeat_interleave(IMAGE_SIZE // 4, 0).repeat_interleave(IMAGE_SIZE // 4, 1)
        out.append(Image.fromarray(pixels.numpy(), "RGB"))
    return out
