"""Recurrent token mixers (Gated DeltaNet, Mamba 1/2, lightning attention, short convolutions,
RG-LRU) served beside the paged KV cache: each keeps a per-sequence state in a slot of the
engine's state pool instead of, or beside, KV blocks. ``base.py`` is the contract."""
