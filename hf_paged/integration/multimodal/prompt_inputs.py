"""One call's image inputs -> each row's ``PromptEmbeds`` (the steps are in the package
docstring): images cut and hashed, features from the encoder cache or one stock encoder batch,
placeholder ranges, M-RoPE positions."""

from __future__ import annotations

import weakref

import torch

from hf_paged.engine.core.encoder_cache import EncoderCache
from hf_paged.engine.core.prompt_embeds import EmbedRange, PromptEmbeds
from hf_paged.integration.multimodal.placeholders import assign
from hf_paged.integration.multimodal.positions import has_mrope, mrope_positions
from hf_paged.models.vision import ImageFeatures, StockVisionTower

# keywords of a multimodal call that are not inputs of ``get_image_features`` but that the
# engine reproduces (token types Qwen's rope index reads)
_POSITION_KEYS = ("mm_token_type_ids",)
# video inputs: the call runs stock by name (``prepare._multimodal_inputs``)
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
_towers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its tower


def is_multimodal(model) -> bool:
    """``model`` is a vision-language model whose decoder the engine can take (a
    ``*ForConditionalGeneration`` of ``AutoModelForImageTextToText`` with image features)."""
    from hf_paged.models.generic.support import image_text_class

    config = getattr(model, "config", None)
    if config is None or image_text_class(config) is None:
        return False
    base = getattr(model, "model", model)
    return callable(getattr(base, "get_image_features", None))


def tower_of(model) -> StockVisionTower:
    """The model's ``StockVisionTower`` (one per model object)."""
    tower = _towers.get(model)
    if tower is None:
        tower = _towers[model] = StockVisionTower(model)
    return tower


def multimodal_keys(model) -> set[str]:
    """The ``generate`` keywords a call on ``model`` may carry besides ``input_ids`` /
    ``attention_mask`` (image inputs and options, token types, video inputs)."""
    from hf_paged.integration.multimodal.image_blocks import type_ids_keys

    keys = set(tower_of(model).input_names) | set(_POSITION_KEYS) | set(VIDEO_KEYS)
    return keys | set(type_ids_keys(model))


def image_token_id(model) -> int:
    """The id the processor expands each image into a run of."""
    config = model.config
    tid = getattr(config, "image_token_id", None)
    if tid is None:
        tid = getattr(config, "image_token_index", None)
    return int(tid)


def encode_images(model, mm_inputs: dict, cache: EncoderCache | None):
    """``(images, features)`` of one call's images in order (``encode_calls`` of one call);
    raises what splitting or the stock tower raises."""
    got = encode_calls(model, [mm_inputs], cache)[0]
    if isinstance(got, Exception):
        raise got
    return got


@torch.no_grad()
def encode_calls(model, calls: list[dict], cache: EncoderCache | None) -> list:
    """Each call's ``(images, features)``: every image's ``ImageInput`` and ``ImageFeatures``
    in the call's order, from ``cache`` or from ONE stock ``get_image_features`` batch over the
    distinct images of all ``calls`` not in it (then kept in ``cache``). A front end that admits
    several calls together (a streaming pipeline) encodes their images in one batch this way.

    A call whose inputs are bad gets its exception in its place instead (the others are
    encoded without it), so one bad call never fails the calls beside it.
    """
    tower = tower_of(model)
    split: list = []
    for mm in calls:
        try:
            split.append(tower.split({k: v for k, v in mm.items() if k in tower.input_names}))
        except Exception as e:  # noqa: BLE001  handed back in the call's place
            split.append(e)
    found = _features(tower, [s for s in split if not isinstance(s, Exception)], cache)
    if isinstance(found, Exception):  # some call's tensors broke the batch: each call alone
        return [_one_call(tower, s, cache) for s in split]
    return [s if isinstance(s, Exception) else (s, [found[i.key] for i in s]) for s in split]


def _one_call(tower, images, cache):
    if isinstance(images, Exception):
        return images
    found = _features(tower, [images], cache)
    return found if isinstance(found, Exception) else (images, [found[i.key] for i in images])


def _features(tower, calls: list[list], cache) -> dict | Exception:
    """Image key -> features for every image of ``calls``: hits from ``cache``, the distinct
    misses encoded in one batch and kept; the exception if the tower raised."""
    found: dict[str, ImageFeatures] = {}
    todo: dict = {}
    for img in (img for images in calls for img in images):
        if img.key in found or img.key in todo:
            continue
        hit = cache.get(img.key) if cache is not None else None
        if hit is not None:
            found[img.key] = hit
        else:
            todo[img.key] = img
    try:
        encoded = tower.encode(list(todo.values()))
    except Exception as e:  # noqa: BLE001  the caller decides (stock's own error)
        return e
    for key, out in zip(todo, encoded, strict=True):
        found[key] = out
        if cache is not None:
            cache.put(key, out)
    return found


def prompt_embeds(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, mm_inputs: dict,
                  cache: EncoderCache | None = None, encoded=None) -> list[PromptEmbeds | None]:  # fmt: skip
    """One ``PromptEmbeds`` per row of ``input_ids`` ``[B, L]`` (None for a row that needs
    none), for the call's multimodal keywords ``mm_inputs``. ``encoded``: the call's entry of
    ``encode_calls`` when the caller encoded several calls together (else encoded here).

    Raises:
        ValueError: stock's error for placeholders that do not match the features, and what
            the stock tower raises for image tensors of a wrong shape.
    """
    rows = [ids[m.bool()].tolist() for ids, m in zip(input_ids, attention_mask, strict=True)]
    positions = mrope_positions(model, input_ids, attention_mask, mm_inputs) if has_mrope(
        model) else None  # fmt: skip
    if mm_inputs.get("pixel_values") is None:  # no images: plain rows (stock merges nothing)
        images, feats = [], []
    elif encoded is not None:
        if isinstance(encoded, Exception):
            raise encoded
        images, feats = encoded
    else:
        images, feats = encode_images(model, mm_inputs, cache)
    try:
        pieces = assign(rows, image_token_id(model), [f.num_rows for f in feats])
    except ValueError:
        _raise_stock_count_error(model, input_ids, feats)
        raise
    out: list[PromptEmbeds | None] = []
    for b, row_pieces in enumerate(pieces):
        pos, delta = positions[b] if positions is not None else (None, 0)
        if not row_pieces and pos is None:
            out.append(None)
            continue
        ranges = [EmbedRange(p.offset, p.length, (images[p.image].key, p.start))
                  for p in row_pieces]  # fmt: skip
        rows_b = [feats[p.image].rows[p.start : p.start + p.length] for p in row_pieces]
        deep = [feats[p.image].deepstack for p in row_pieces]
        hidden = _hidden_size(model)
        emb = torch.cat(rows_b) if rows_b else torch.zeros(0, hidden, device=input_ids.device)
        ds = None
        if row_pieces and all(d is not None for d in deep):
            ds = torch.cat([d[:, p.start : p.start + p.length] for d, p in zip(deep, row_pieces)],
                           dim=1)  # fmt: skip
        out.append(PromptEmbeds(ranges, emb, deepstack=ds, positions=pos, position_delta=delta))
    return out


def _raise_stock_count_error(model, input_ids, feats) -> None:
    """Raise the error stock's own placeholder check raises for these features (its counts are
    worded per family), where the model has that check; return when it has none."""
    base = getattr(model, "model", model)
    check = getattr(base, "get_placeholder_mask", None)
    if check is None or not feats:
        return
    embeds = model.get_input_embeddings()(input_ids)  # [B, L, H]
    features = torch.cat([f.rows for f in feats]).to(embeds.dtype)
    check(input_ids, inputs_embeds=embeds, image_features=features)


def _hidden_size(model) -> int:
    return model.config.get_text_config().hidden_size
