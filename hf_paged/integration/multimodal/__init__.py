"""Vision-language models on the engine: the vision tower runs stock on the prefill side, the
decoder runs paged and takes the image features as prompt embeddings.

How a ``generate`` call with images becomes engine requests (``prompt_inputs.prompt_embeds``):

1. The call's image inputs (``pixel_values``, ``image_grid_thw``, ``image_sizes``,
   ``pixel_attention_mask`` ... whatever the model's ``get_image_features`` takes) are cut into
   single images by the model's ``StockVisionTower`` (``models/vision``), each with a content
   hash (pixels, grid or size, options).
2. The encoder cache (``engine/core/encoder_cache.py``, the engine's, in ``runtime``) is asked
   for each hash; the misses run through stock ``get_image_features`` in one batch and are kept.
   Rows, beams, ``num_return_sequences`` and later calls share an image's features.
3. Placeholder ranges (``placeholders.py``): the runs of the image token id in each row's
   attended tokens (left padding stripped), found once, here. Features are handed out in the
   order stock's ``masked_scatter`` uses (row by row, run by run), so a run may hold several
   images and an image may span several runs (Idefics3's crops). A count that differs from the
   features raises stock's own error.
4. Each row's ranges become an ``EngineRequest.prompt_embeds`` (``engine/core/prompt_embeds.py``):
   every range keyed by ``(image hash, offset inside the image)``, so the prefix cache shares KV
   only between equal images at equal places; the runner slices the rows per prefill chunk, so
   a chunk may split an image.
5. Qwen's M-RoPE (``positions.py``): stock's ``get_rope_index`` with the attention mask, once,
   giving each row ``[3, L]`` positions and its delta; decode runs at ``t + delta``. Qwen3-VL's
   DeepStack rows travel with the image rows and are added after the decoder's first layers.

The decoder is the generic path over the whole ``*ForConditionalGeneration`` class
(``models/generic``): its ``language_model`` is the backbone, its ``lm_head`` the head.
Families whose image tokens attend bidirectionally (Gemma 3) get each row's bidirectional
ranges from its type ids (``image_blocks.py``, rules in ``models/image_masks.py``): the
attention opens each image's tokens to each other and the scheduler keeps an image in one
prefill chunk. Blocks the ranges cannot express are refused by name.

Interface for front ends (pipeline, lm-eval, ``LLM``): ``multimodal_keys(model)`` names the
keywords a call may carry, and ``prompt_embeds(model, input_ids, attention_mask, mm_inputs,
encoder_cache)`` returns one ``PromptEmbeds`` (or None) per row of ``input_ids``. A front end that
admits several calls together encodes all their images in one stock batch with
``encode_calls(model, [mm_inputs, ...], encoder_cache)`` and passes each call's entry as
``prompt_embeds(..., encoded=)``; a bad call's entry is its exception, raised for that call only.
``generate`` itself encodes the images of one call in one batch.
"""

from hf_paged.integration.multimodal.prompt_inputs import (
    VIDEO_KEYS,
    encode_calls,
    is_multimodal,
    multimodal_keys,
    prompt_embeds,
)

__all__ = ["VIDEO_KEYS", "encode_calls", "is_multimodal", "multimodal_keys", "prompt_embeds"]
