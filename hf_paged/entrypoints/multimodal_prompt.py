"""vLLM's multimodal prompt for ``LLM.generate``: ``{"prompt": text, "multi_modal_data":
{"image": image or [images]}}`` -> one ``EngineRequest`` with the images' features.

The text holds the model's own image placeholder (``<start_of_image>`` for Gemma 3, ``<image>``
for LLaVA ...), as vLLM's does; the model's processor expands it and makes the pixel inputs.
The vision tower runs stock on the prefill side (``integration/multimodal``): features from the
engine's encoder cache or one stock encoder pass, placeholder runs, M-RoPE positions and, for
Gemma 3, the image's bidirectional ranges. The processor comes from ``LLM(processor=...)`` or is
loaded from the checkpoint directory; for a checkpoint directory the stock model is loaded once
for its vision tower (the engine holds the decoder).
"""

from __future__ import annotations

MM_KEY = "multi_modal_data"
_MODALITIES = ("image",)


def is_multimodal_prompt(prompt) -> bool:
    return isinstance(prompt, dict) and MM_KEY in prompt


def check_multimodal_prompt(prompt: dict) -> tuple[str, list]:
    """``(text, images)`` of a multimodal prompt dict.

    Raises:
        ValueError / TypeError: other keys, no text, another modality, no image.
    """
    keys = sorted(map(str, prompt))
    if set(prompt) != {"prompt", MM_KEY} or not isinstance(prompt["prompt"], str):
        raise ValueError(
            f"prompts=<dict with keys {keys}> is not allowed: a multimodal prompt is "
            f'{{"prompt": <text with the image placeholder>, "{MM_KEY}": {{"image": ...}}}}'
        )
    data = prompt[MM_KEY]
    if not isinstance(data, dict) or set(data) - set(_MODALITIES) or "image" not in data:
        raise ValueError(
            f"{MM_KEY}={data!r} is not allowed: must be a dict with the key 'image' (an image "
            "or a list of images); other modalities are not served"
        )
    images = data["image"]
    images = list(images) if isinstance(images, (list, tuple)) else [images]
    if not images:
        raise ValueError(f"{MM_KEY}={{'image': []}} is not allowed: give at least one image")
    return prompt["prompt"], images


def multimodal_request_fields(model, processor, engine, text: str, images: list) -> dict:
    """``EngineRequest`` fields for one prompt: ``prompt_token_ids``, ``prompt_embeds`` and
    ``bidirectional_ranges``.

    Raises:
        ValueError: the processor's or stock's own error for placeholders that do not match
            the images.
    """
    from hf_paged.integration.multimodal import multimodal_keys, prompt_embeds
    from hf_paged.integration.multimodal.image_blocks import row_ranges

    inputs = processor(text=[text], images=[images], return_tensors="pt")
    # the processor's tensors (on the CPU) go where the model is, as a caller of generate moves them
    param = next(model.parameters())
    ids, mask = inputs["input_ids"].to(param.device), inputs["attention_mask"].to(param.device)
    keys = multimodal_keys(model)
    mm = {k: v.to(param.device, param.dtype if v.is_floating_point() else v.dtype)
          for k, v in inputs.items() if k in keys}  # fmt: skip
    embeds = prompt_embeds(model, ids, mask, mm, engine.runtime.encoder_cache)[0]
    ranges = row_ranges(model, mask, mm)
    return {
        "prompt_token_ids": engine.validate_prompt(ids[0][mask[0].bool()]),
        "prompt_embeds": embeds,
        "bidirectional_ranges": None if ranges is None else ranges[0],
    }


def load_vision_side(model_path: str):
    """The stock vision-language model and processor of a checkpoint directory."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(model_path, dtype="auto").eval()
    return model, AutoProcessor.from_pretrained(model_path)
