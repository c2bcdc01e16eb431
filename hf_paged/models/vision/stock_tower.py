"""A vision-language model's own vision tower and projector, one interface for every family.

The tower runs stock: ``model.get_image_features`` (what transformers' ``generate`` calls before
prefill), never a reimplementation. What differs per family is only how a call's image inputs are
laid out, so this module cuts them into single images and puts a batch of single images back
together, in one of three layouts:

* ``"grid"`` (Qwen2/2.5/3-VL): ``pixel_values [sum t*h*w, C*T*P*P]`` flattened patches plus
  ``image_grid_thw [n, 3]``; image ``i`` owns ``prod(grid[i])`` rows.
* ``"nested"`` (Idefics3, SmolVLM): ``pixel_values [B, n, C, H, W]`` per prompt row, padded with
  all-zero images, plus ``pixel_attention_mask [B, n, H, W]``; padding images are not images.
* ``"leading"`` (LLaVA, LLaVA-NeXT, LLaVA-OneVision, Mistral 3, Gemma 3, Llama 4 tiles): every
  image tensor has one entry per image on dim 0 (``pixel_values``, ``image_sizes``); the
  processor's batch padding (LLaVA-NeXT's crops, Pixtral's height and width) is cut off by the
  image's own size, so an image looks the same in any batch.

An ``ImageInput`` is one image's tensors plus the call's non-tensor options; its ``key`` hashes
all of them (bytes, dtype, shape, options, the tower's family), the encoder cache's key. ``encode``
runs a list of images in one ``get_image_features`` call and returns each image's rows (and
Qwen3-VL's DeepStack rows), in the order given.
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass, field

import torch

# inputs of get_image_features that are not image data (the model fills them from its config)
_OPTION_NAMES = ("vision_feature_layer", "vision_feature_select_strategy", "vision_aspect_ratio")


@dataclass
class ImageFeatures:
    """One image's features as the decoder takes them."""

    rows: torch.Tensor  # [N, hidden]: the rows its N placeholder tokens get
    deepstack: torch.Tensor | None = None  # [num_layers, N, hidden] (Qwen3-VL) or None

    @property
    def num_rows(self) -> int:
        return int(self.rows.shape[0])


@dataclass
class ImageInput:
    """One image's inputs to ``get_image_features`` (tensors with a leading dim of 1, or the
    grid layout's rows), and the options of the call."""

    tensors: dict[str, torch.Tensor]
    options: dict = field(default_factory=dict)
    key: str = ""  # content hash, set by ``StockVisionTower.split``


class StockVisionTower:
    """``get_image_features`` of one HF vision-language model, image by image.

    Args:
        model: the HF ``*ForConditionalGeneration`` model (its vision tower runs as stock runs
            it: same module, same weights, same device).

    Raises:
        ValueError: the model has no ``get_image_features``.
    """

    def __init__(self, model):
        base = getattr(model, "model", model)
        fn = getattr(base, "get_image_features", None) or getattr(model, "get_image_features", None)
        if fn is None:
            raise ValueError(f"{type(model).__name__} has no get_image_features")
        self.model = model
        self.encode_fn = fn
        sig = inspect.signature(fn).parameters
        self.params = [p for p in sig if p != "kwargs"]
        self.config = model.config
        # options older transformers require without a default (Llama 4's
        # ``vision_feature_select_strategy``); newer ones fill them from the config themselves
        self.config_options = {
            p: getattr(self.config, p)
            for p, v in sig.items()
            if v.default is inspect.Parameter.empty
            and p in _OPTION_NAMES
            and getattr(self.config, p, None) is not None
        }
        self.family = getattr(self.config, "model_type", type(model).__name__)
        if "image_grid_thw" in self.params:
            self.layout = "grid"
        elif "pixel_attention_mask" in self.params:
            self.layout = "nested"
        else:
            self.layout = "leading"

    @property
    def input_names(self) -> list[str]:
        """The ``generate`` keywords this tower reads (image data and options)."""
        return self.params

    # ---- cutting a call's inputs into images --------------------------------------------------

    def split(self, inputs: dict) -> list[ImageInput]:
        """The call's images in order (the order their placeholder runs take features in).

        Args:
            inputs: the call's keywords that are ``get_image_features`` parameters.

        Raises:
            ValueError: tensors whose shapes do not agree with the layout (named).
        """
        tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        options = {k: v for k, v in inputs.items() if k not in tensors and v is not None}
        if "pixel_values" not in tensors:
            raise ValueError("pixel_values is missing: the image inputs have no pixels")
        images = getattr(self, f"_split_{self.layout}")(tensors)
        for img in images:
            img.options = options
            img.key = self._hash(img)
        return images

    def _split_grid(self, t: dict) -> list[ImageInput]:
        pixels, grid = t["pixel_values"], t.get("image_grid_thw")
        if grid is None or grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(
                f"image_grid_thw={None if grid is None else list(grid.shape)} is not allowed: "
                "must be [num_images, 3] (t, h, w of each image)"
            )
        sizes = grid.prod(-1).tolist()
        if pixels.dim() != 2 or pixels.shape[0] != sum(sizes):
            raise ValueError(
                f"pixel_values of shape {list(pixels.shape)} is not allowed: image_grid_thw "
                f"gives {sum(sizes)} patch rows ([sum t*h*w, C*T*P*P])"
            )
        out = []
        for i, part in enumerate(torch.split(pixels, sizes)):
            out.append(ImageInput({"pixel_values": part, "image_grid_thw": grid[i : i + 1]}))
        return out

    def _split_nested(self, t: dict) -> list[ImageInput]:
        pixels, mask = t["pixel_values"], t.get("pixel_attention_mask")
        if pixels.dim() != 5:
            raise ValueError(
                f"pixel_values of shape {list(pixels.shape)} is not allowed: must be "
                "[batch, images, channels, height, width]"
            )
        flat = pixels.reshape(-1, *pixels.shape[2:])
        masks = None if mask is None else mask.reshape(-1, *mask.shape[2:])
        real = (flat == 0.0).flatten(1).sum(-1) != flat[0].numel()  # stock drops all-zero images
        out = []
        for i in torch.nonzero(real).flatten().tolist():
            d = {"pixel_values": flat[i : i + 1, None]}  # [1, 1, C, H, W]: its own batch row
            if masks is not None:
                d["pixel_attention_mask"] = masks[i : i + 1, None]
            out.append(ImageInput(d))
        return out

    def _split_leading(self, t: dict) -> list[ImageInput]:
        pixels = t["pixel_values"]
        n = pixels.shape[0]
        for k, v in t.items():
            if v.dim() == 0 or v.shape[0] != n:
                raise ValueError(
                    f"{k} of shape {list(v.shape)} is not allowed: its first dim must be the "
                    f"number of images, {n} (pixel_values {list(pixels.shape)})"
                )
        return [ImageInput(self._unpad({k: v[i : i + 1] for k, v in t.items()})) for i in range(n)]

    def _unpad(self, d: dict) -> dict:
        """One image's tensors without the batch's padding (cut by its own size)."""
        sizes = d.get("image_sizes")
        if sizes is None:
            return d
        h, w = (int(x) for x in sizes[0].tolist())
        pixels = d["pixel_values"]
        grid = getattr(self.config, "image_grid_pinpoints", None)
        if grid is not None and pixels.dim() == 5:  # LLaVA-NeXT crops: as many as its size needs
            from transformers.models.llava_next.modeling_llava_next import (
                image_size_to_num_patches,
            )

            n = image_size_to_num_patches((h, w), grid, self.config.vision_config.image_size)
            return {**d, "pixel_values": pixels[:, :n]}
        if pixels.dim() == 4:  # Pixtral: the image is its top-left h x w
            return {**d, "pixel_values": pixels[..., :h, :w]}
        return d

    def _hash(self, img: ImageInput) -> str:
        h = hashlib.sha256(self.family.encode())
        for k in sorted(img.tensors):
            v = img.tensors[k].detach().contiguous().cpu()
            h.update(f"{k}|{v.dtype}|{list(v.shape)}".encode())
            h.update(v.view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        h.update(repr(sorted((k, repr(v)) for k, v in img.options.items())).encode())
        return h.hexdigest()

    # ---- running the tower ----------------------------------------------------------------

    @torch.no_grad()
    def encode(self, images: list[ImageInput]) -> list[ImageFeatures]:
        """Features of ``images``: per image its rows ``[N, hidden]`` (the rows its N placeholder
        tokens get) and DeepStack rows. One stock ``get_image_features`` call per group of
        images that batch as the processor would batch them (same options; same shapes, unless
        the family cuts batch padding off by each image's ``image_sizes``)."""
        groups: dict = {}
        for i, img in enumerate(images):
            groups.setdefault(self._batch_key(img), []).append(i)
        out: list = [None] * len(images)
        for idx in groups.values():
            for i, feats in zip(idx, self._encode_batch([images[i] for i in idx]), strict=True):
                out[i] = feats
        return out

    def _batch_key(self, img: ImageInput) -> tuple:
        options = repr(sorted((k, repr(v)) for k, v in img.options.items()))
        if self.layout == "grid" or "image_sizes" in img.tensors:
            return (options,)
        return (options, tuple((k, tuple(v.shape)) for k, v in sorted(img.tensors.items())))

    def _encode_batch(self, images: list[ImageInput]) -> list[ImageFeatures]:
        options = {**self.config_options, **images[0].options}
        kwargs = {**options, **self._collate([img.tensors for img in images])}
        out = self.encode_fn(**kwargs, return_dict=True)
        pooled = out.pooler_output
        per_image = list(pooled) if not isinstance(pooled, torch.Tensor) else list(pooled.unbind(0))
        if len(per_image) != len(images):
            raise RuntimeError(
                f"{type(self.model).__name__}.get_image_features gave {len(per_image)} outputs "
                f"for {len(images)} images"
            )
        rows = [f.reshape(-1, f.shape[-1]) for f in per_image]
        deep = _per_image(getattr(out, "deepstack_features", None), [r.shape[0] for r in rows])
        results = []
        for i, r in enumerate(rows):
            ds = None
            if deep:
                ds = torch.stack([layer[i].reshape(-1, r.shape[-1]) for layer in deep])
            results.append(ImageFeatures(r, ds))
        return results

    def _collate(self, items: list[dict]) -> dict:
        if self.layout == "grid":
            return {
                "pixel_values": torch.cat([d["pixel_values"] for d in items]),
                "image_grid_thw": torch.cat([d["image_grid_thw"] for d in items]),
            }
        return {k: cat_padded([d[k] for d in items]) for k in items[0]}


def _per_image(deep, sizes: list[int]):
    """Qwen3-VL's DeepStack features as one sequence per layer of per-image rows (older
    transformers return each layer's rows of all images in one tensor: split by ``sizes``)."""
    if not deep:
        return None
    return [torch.split(layer, sizes) if isinstance(layer, torch.Tensor) else layer
            for layer in deep]  # fmt: skip


def cat_padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate on dim 0, zero-padding the other dims to the largest (the processor's own
    batch padding, which the towers cut off by each image's size)."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    if all(list(t.shape[1:]) == shape for t in tensors):
        return torch.cat(tensors)
    out = tensors[0].new_zeros(sum(t.shape[0] for t in tensors), *shape)
    at = 0
    for t in tensors:
        out[(slice(at, at + t.shape[0]), *(slice(0, s) for s in t.shape[1:]))] = t
        at += t.shape[0]
    return out
