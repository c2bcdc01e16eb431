"""Paged attention kernels (prefill, decode, the KV store) and what they share, each beside its
torch reference."""
