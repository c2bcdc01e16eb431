"""``hf_paged.ray``: the import path of ``map_generate`` (``entrypoints/ray.py``).

``import hf_paged.ray`` and ``from hf_paged.ray import map_generate`` load it; without
``ray[data]`` installed they raise an ImportError that says how to install it.
"""

from __future__ import annotations

from hf_paged.entrypoints.ray import map_generate

__all__ = ["map_generate"]
