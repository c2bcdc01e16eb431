"""LoRA on the engine's linear layers: each wrapped layer runs its base GEMM once, then adds every
token's adapter delta for each of its output slices (``kernels/lora_segmented.py``).

A layer is wrapped in place: its class becomes a subclass whose ``forward`` adds the delta, and
its slots hang off it as a plain attribute (``layer.lora``, not a submodule), so parameter names,
the state dict and weight loading stay as they were. Slices follow the HF modules the layer
holds: the native ``qkv_proj`` is ``q_proj | k_proj | v_proj`` and ``gate_up_proj`` is
``gate_proj | up_proj`` (each with its own ``A`` and ``B`` per slot); unfused layers and the
generic path's ``nn.Linear`` modules are one slice. The delta goes after the base layer's own
output (a row-parallel layer's after its all-reduce), which is why the engine serves LoRA at
``tensor_parallel_size=1`` only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.kernels.lora_segmented import LoraSegments, segmented_lora, supports
from hf_paged.models.peft import LORA_TARGETS

# the modules an adapter may target (their HF names' last part)
TARGETS = LORA_TARGETS
# native fused module -> its HF modules, in output order
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class LoraStep:
    """The current step's tokens by slot, shared by every wrapped layer of one engine (set by
    ``LoraManager.prepare`` before a forward; ``segments`` None: no token has an adapter)."""

    def __init__(self):
        self.segments: LoraSegments | None = None
        self.uniform_slot: int | None = None  # every token under this one slot
        self.token_slots: torch.Tensor | None = None  # [T] int64; no adapter: the zero slot


# up to this many tokens a step's deltas are dense matmuls over every slot on the CPU (no
# per-adapter loop, ``LayerLora._dense``); longer steps loop over the adapters' token segments
GATHER_MAX_TOKENS = 64


@dataclass
class LoraSlice:
    """One HF module's share of a wrapped layer's output and its stacked factors. Every stack has
    ``max_loras + 1`` slots: the last stays zero (tokens without an adapter)."""

    hf_name: str  # e.g. "model.layers.0.self_attn.k_proj"
    offset: int  # first output column
    size: int  # output columns
    in_size: int
    a: torch.Tensor  # [S + 1, R, in]: a view into the layer's ``a_all``
    b: torch.Tensor  # [S + 1, size, R]: a view of ``b_flat``
    b_flat: torch.Tensor  # [size, (S + 1) * R]: every slot's B side by side
    scales: torch.Tensor  # [S + 1] float32; 0 where the slot's adapter leaves this module alone
    ranks: list[int]  # per slot: the adapter's own rank (the slot is zero past it)
    scale_values: list[float]  # ``scales`` on the host


class LayerLora:
    """A wrapped layer's slices and the step they read. The slices' ``A`` are stacked along the
    rank in ``a_all [S + 1, n * R, in]`` so that one matmul shrinks a token for every slice."""

    def __init__(self, slices: list[LoraSlice], step: LoraStep, a_all: torch.Tensor, rank: int):
        self.slices = slices
        self.step = step
        self.a_all = a_all
        self.rank = rank
        # CPU, fused layers: per slot every slice's B as one block-diagonal matrix and the
        # output columns' scales, so a one-adapter step expands in one matmul (a GPU's launches
        # are cheap: it keeps one matmul per slice and the memory)
        self.b_diag = self.col_scales = None
        if a_all.device.type == "cpu" and len(slices) > 1:
            out = sum(s.size for s in slices)
            self.b_diag = a_all.new_zeros(a_all.shape[0], out, a_all.shape[1])  # [S+1, out, nR]
            self.col_scales = torch.zeros(a_all.shape[0], out, dtype=torch.float32)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [..., out] plus each token's delta; ``x`` [..., in]."""
        step = self.step
        if step.segments is None:
            return out
        x2, o2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        xs = x2.to(self.a_all.dtype)
        if step.uniform_slot is not None:
            self._uniform(xs, o2, step.uniform_slot)
        elif supports(xs) or xs.shape[0] > GATHER_MAX_TOKENS:
            for s in self.slices:
                segmented_lora(xs, o2, s.a, s.b, s.scales, step.segments, s.offset)
        else:
            self._dense(xs, o2, step.token_slots)
        return out

    def _uniform(self, xs, o2, slot: int) -> None:
        """One adapter for the whole step: no gather or scatter; each slice's delta is PEFT's
        ``lora_B(lora_A(x)) * scaling`` (a short step with ``b_diag``: every slice in one matmul,
        the other slices' blocks exact zeros; a long one per slice, without their flops)."""
        y = xs @ self.a_all[slot].T  # [T, n * R]
        if self.b_diag is not None and xs.shape[0] <= GATHER_MAX_TOKENS:  # decode: few ops
            first, last = self.slices[0].offset, self.slices[-1].offset + self.slices[-1].size
            delta = (y @ self.b_diag[slot].T) * self.col_scales[slot]  # [T, out]
            o2[:, first:last] += delta.to(o2.dtype)
            return
        for j, s in enumerate(self.slices):
            r = s.ranks[slot]
            if r:
                first = j * self.rank
                delta = (y[:, first : first + r] @ s.b[slot, :, :r].T) * s.scale_values[slot]
                o2[:, s.offset : s.offset + s.size] += delta.to(o2.dtype)

    def _dense(self, xs, o2, token_slots) -> None:
        """Few tokens, mixed slots: every token against every slot in dense matmuls, each token's
        own slot kept by a one-hot mask (exact zeros elsewhere), so there is no per-adapter loop
        and no per-token gather of factors."""
        t, slots = xs.shape[0], self.a_all.shape[0]
        onehot = torch.zeros(t, slots, 1, dtype=xs.dtype, device=xs.device)
        onehot[torch.arange(t, device=xs.device), token_slots] = 1.0
        y = (xs @ self.a_all.view(-1, xs.shape[1]).T).view(t, slots, -1) * onehot  # [T, S+1, nR]
        for j, s in enumerate(self.slices):
            first = j * self.rank
            yj = y[:, :, first : first + self.rank].reshape(t, -1)  # [T, (S+1) * R]
            delta = (yj @ s.b_flat.T) * s.scales[token_slots][:, None]  # [T, size]
            o2[:, s.offset : s.offset + s.size] += delta.to(o2.dtype)

    def write(self, slot: int, layers: dict) -> None:
        """Slot ``slot`` takes an adapter's factors (``{hf_name: LoraFactors}``), zero-padded
        to the slot rank; slices the adapter does not adapt get scale 0."""
        for s in self.slices:
            f = layers.get(s.hf_name)
            s.a[slot].zero_()
            s.b[slot].zero_()
            r = s.ranks[slot] = 0 if f is None else f.rank
            s.scale_values[slot] = 0.0 if f is None else f.scale
            s.scales[slot] = s.scale_values[slot]
            if f is not None:
                s.a[slot, :r].copy_(f.a)
                s.b[slot, :, :r].copy_(f.b)
        if self.b_diag is not None:  # the block-diagonal copy of the slices' B
            self.b_diag[slot].zero_()
            first = self.slices[0].offset
            for j, s in enumerate(self.slices):
                rows = slice(s.offset - first, s.offset - first + s.size)
                self.b_diag[slot, rows, j * self.rank : (j + 1) * self.rank] = s.b[slot]
                self.col_scales[slot, rows] = s.scale_values[slot]


_WRAPPED: dict[type, type] = {}


def _with_lora(cls: type) -> type:
    """``cls`` with a ``forward`` that adds ``self.lora``'s delta to the base output."""
    sub = _WRAPPED.get(cls)
    if sub is None:

        def forward(self, x, *args, **kwargs):
            return self.lora.apply(x, cls.forward(self, x, *args, **kwargs))

        sub = type(f"Lora{cls.__name__}", (cls,), {"forward": forward})
        _WRAPPED[cls] = sub
    return sub


def _slices_of(name: str, module: nn.Module) -> list[tuple[str, int, int]] | None:
    """``(hf_name, offset, size)`` per HF module a linear layer holds, or None (not a target)."""
    prefix, _, leaf = name.rpartition(".")
    if leaf in _FUSED and hasattr(module, "shard_slice"):  # a native fused layer
        out = []
        for hf_leaf, shard in zip(_FUSED[leaf], module.shard_ids(), strict=True):
            s = module.shard_slice(shard)
            out.append((f"{prefix}.{hf_leaf}", s.dst, s.size))
        return out
    if leaf not in TARGETS:
        return None
    size = getattr(module, "output_size", None) or getattr(module, "out_features", None)
    return [(name, 0, size)] if size else None


def attach_lora(model: nn.Module, hf_prefix: str, max_loras: int, max_rank: int,
                dtype: torch.dtype, device) -> tuple[LoraStep, dict[str, LoraSlice], list]:  # fmt: skip
    """Wrap every target linear layer of ``model`` with ``max_loras`` zeroed slots of rank
    ``max_rank``. ``hf_prefix`` is removed from module names to give HF names (the generic
    path's HF model sits under an attribute).

    Returns:
        (the shared ``LoraStep``, ``{hf_name: LoraSlice}``, the wrapped layers' ``LayerLora``).
    """
    step = LoraStep()
    by_name: dict[str, LoraSlice] = {}
    layers = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) and not hasattr(module, "shard_slice"):
            continue
        hf = name.removeprefix(hf_prefix)
        slices = _slices_of(hf, module)
        if not slices:
            continue
        in_size = getattr(module, "input_size", None) or module.in_features
        slots, n = max_loras + 1, len(slices)  # the last slot stays zero: no adapter
        a_all = torch.zeros(slots, n * max_rank, in_size, dtype=dtype, device=device)
        made = []
        for j, (hf_name, offset, size) in enumerate(slices):
            b_flat = torch.zeros(size, slots * max_rank, dtype=dtype, device=device)
            s = LoraSlice(
                hf_name, offset, size, in_size,
                a=a_all[:, j * max_rank : (j + 1) * max_rank],
                b=b_flat.view(size, slots, max_rank).permute(1, 0, 2), b_flat=b_flat,
                scales=torch.zeros(slots, dtype=torch.float32, device=device),
                ranks=[0] * slots, scale_values=[0.0] * slots,
            )  # fmt: skip
            made.append(s)
            by_name[hf_name] = s
        module.lora = LayerLora(made, step, a_all, max_rank)
        module.__class__ = _with_lora(type(module))
        layers.append(module.lora)
    return step, by_name, layers
