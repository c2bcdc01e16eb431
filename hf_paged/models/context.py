"""Re-export: ``ModelContext`` lives in ``hf_paged.layers.context`` (below layers and models)."""

from hf_paged.layers.context import ModelContext

__all__ = ["ModelContext"]
