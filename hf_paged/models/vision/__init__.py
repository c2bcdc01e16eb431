"""Vision towers behind one interface: the model's own (stock) tower and projector, cut image by
image (``stock_tower.StockVisionTower``). Nothing here reimplements a tower."""

from hf_paged.models.vision.stock_tower import ImageFeatures, ImageInput, StockVisionTower

__all__ = ["ImageFeatures", "ImageInput", "StockVisionTower"]
