"""Images of the tiny_vqa task, generated from each doc's seed (nothing is stored or downloaded):
16x16 RGB, a 4x4 grid of random colour blocks."""

import numpy as np
from PIL import Image


def doc_to_image(doc):
    rng = np.random.default_rng(doc["seed"])
    blocks = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return [Image.fromarray(blocks.repeat(4, 0).repeat(4, 1), "RGB")]
