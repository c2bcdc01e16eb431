"""The paged KV cache: one spec per attention layer, and the cache the ModelRunner owns.

The runner sizes a :class:`KVCache` from the model's ``kv_cache_specs`` and passes it to every
forward in ``AttentionMetadata.kv_cache``; an attention layer with KV layer index ``i`` reads
``meta.kv_cache[i]``. Nothing is hung on modules.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    """One attention layer's KV cache on this rank."""

    num_kv_heads: int  # on this rank
    head_dim: int  # K head dim
    head_dim_v: int  # V head dim (MLA's naive form: K 192, V 128)
    sliding_window: int | None = None  # informational (the cache still keeps every token)

    def __post_init__(self) -> None:
        for name in ("num_kv_heads", "head_dim", "head_dim_v"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"KVCacheSpec {name}={value!r} is not allowed: an int >= 1")

    def block_bytes(self, block_size: int, element_size: int) -> int:
        """Bytes of one block of this layer, K and V."""
        return block_size * self.num_kv_heads * (self.head_dim + self.head_dim_v) * element_size


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """A zero tensor. On the CPU from ``calloc`` (numpy's zeros): a large one is mapped from
    the OS's zero pages, so it costs nothing until written (``torch.zeros`` writes every byte:
    0.3 s for 512 MiB)."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


class KVCache:
    """The paged K/V caches of every layer; owned by the ModelRunner.

    ``kv_cache[layer] -> (k_cache, v_cache)`` of shapes
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` / ``[..., head_dim_v]``, contiguous.
    One block id addresses the same tokens in every layer. Layers with equal specs share one
    allocation ``[2, n_layers, num_blocks, block_size, num_kv_heads, head_dim]`` (K and V
    together when their head dims agree), so a uniform model has today's single tensor and every
    layer's caches have the same strides. Zero-filled (a graph's padding rows read them); on the
    CPU with zero pages from the OS (``_zeros``), so allocating costs no time and memory is
    committed only where blocks are written.
    A model of recurrent layers alone (Mamba) has no specs: the cache then holds nothing and its
    blocks are bookkeeping only.

    Raises:
        ValueError: a block count < 1.
    """

    def __init__(
        self,
        specs: list[KVCacheSpec],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks={num_blocks}, block_size={block_size}: both must be >= 1")
        self.specs = list(specs)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = [None] * len(specs)  # type: ignore[list-item]
        self.storage: list[torch.Tensor] = []  # the allocations, one or two per distinct spec
        self.released = False
        groups: dict[KVCacheSpec, list[int]] = {}
        for i, spec in enumerate(self.specs):
            groups.setdefault(spec, []).append(i)
        for spec, layers in groups.items():
            k_all, v_all = self._allocate(spec, len(layers), device)
            for j, i in enumerate(layers):
                self._layers[i] = (k_all[j], v_all[j])

    def _allocate(self, spec: KVCacheSpec, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``n`` layers: [n, num_blocks, block_size, H, D] each (Dv for V)."""
        shape = (n, self.num_blocks, self.block_size, spec.num_kv_heads)
        if spec.head_dim == spec.head_dim_v:
            kv = _zeros((2, *shape, spec.head_dim), self.dtype, device)
            self.storage.append(kv)
            return kv[0], kv[1]
        k = _zeros((*shape, spec.head_dim), self.dtype, device)
        v = _zeros((*shape, spec.head_dim_v), self.dtype, device)
        self.storage += [k, v]
        return k, v

    @staticmethod
    def block_bytes(specs: list[KVCacheSpec], block_size: int, dtype: torch.dtype) -> int:
        """Bytes one block id costs: summed over layers, K and V."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return sum(s.block_bytes(block_size, elem) for s in specs)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)`` of KV layer ``layer``.

        Raises:
            RuntimeError: after ``release``.
            IndexError: ``layer`` outside 0..len-1.
        """
        if self.released:
            raise RuntimeError("this KVCache was released")
        return self._layers[layer]

    def __len__(self) -> int:
        return len(self.specs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy block ``src`` onto block ``dst`` for each ``(src, dst)``, K and V of every layer
        (copy on write of forked blocks). Every source is read before any destination is
        written; destinations must be distinct."""
        if not pairs or not self.storage:
            return
        device = self.storage[0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.long, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.long, device=device)
        for t in self.storage:  # [2, n, num_blocks, ...] (K and V together) or [n, num_blocks, ...]
            dim = t.dim() - 4
            t.index_copy_(dim, dst, t.index_select(dim, src))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.storage)

    def release(self) -> None:
        """Drop every tensor (the memory returns once no view is left elsewhere)."""
        self._layers = [None] * len(self.specs)  # type: ignore[list-item]
        self.storage = []
        self.released = True

    def __repr__(self) -> str:
        return (
            f"KVCache(layers={len(self)}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, dtype={self.dtype}, allocations={len(self.storage)})"
        )
