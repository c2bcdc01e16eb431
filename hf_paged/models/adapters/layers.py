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

import math
from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.kernels.lora_per_token import lora_per_token
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
        # CUDA decode steps: each token's slot on the device ([T] int32, -1: no adapter), read
        # by the per-token kernels (``kernels/lora_per_token.py``); a decode graph's static
        # buffer while it is captured. Set: the layers read nothing else.
        self.decode_slots: torch.Tensor | None = None


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


# a fused layer's one-adapter expand is one matmul over a block-diagonal B (``SlotOperands.b_t``)
# while the step's multiplies by its zero blocks, per slice it saves, stay below this many: beyond,
# they cost more than the per-slice matmul, scale and add (measured on one CPU thread)
BLOCK_DIAG_WASTE_MAX = 1 << 18
# the largest block-diagonal B kept per slot (elements)
BLOCK_DIAG_MAX = 1 << 20


@dataclass(frozen=True)
class SlotOperands:
    """One slot's factors laid out for a step whose tokens all use it (``LayerLora._uniform``):
    only the slices the adapter adapts, at the adapter's own ranks (a PEFT model's slots are
    padded to rank 16 or more), ready to multiply without a per-step copy."""

    a_t: torch.Tensor  # [in, sum r]: the adapted slices' A, transposed, side by side
    slices: tuple  # per adapted slice: (first y column, rank, B^T [r, size], scaling, columns)
    # one expand for every slice (one slice, or a small fused layer on the CPU): B^T [sum r, out]
    # (block-diagonal over the slices; exact zeros elsewhere) and the scaling per output column
    # (a 0-dim tensor for one slice; None: every scaling a power of two, folded into B^T);
    # b_t None: per slice (whose scaling is None where folded)
    b_t: torch.Tensor | None
    scales: torch.Tensor | None
    waste: int = 0  # with ``b_t``: multiplies by its zero blocks per token, per slice saved


class LayerLora:
    """A wrapped layer's slices and the step they read. The slices' ``A`` are stacked along the
    rank in ``a_all [S + 1, n * R, in]`` so that one matmul shrinks a token for every slice."""

    def __init__(self, slices: list[LoraSlice], step: LoraStep, a_all: torch.Tensor, rank: int):
        self.slices = slices
        self.step = step
        self.a_all = a_all
        self.rank = rank
        self.first = slices[0].offset  # the output columns the slices cover
        self.last = slices[-1].offset + slices[-1].size
        # per slot: its ``SlotOperands`` (None: the adapter leaves this layer alone)
        self.operands: list[SlotOperands | None] = [None] * a_all.shape[0]

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` [..., out] plus each token's delta; ``x`` [..., in]."""
        step = self.step
        if step.segments is None and step.decode_slots is None:
            return out
        xs = x.reshape(-1, x.shape[-1])
        o2 = out.reshape(-1, out.shape[-1])  # a view (the base output is contiguous)
        if xs.dtype != self.a_all.dtype:  # PEFT casts the input to the adapter's dtype
            xs = xs.to(self.a_all.dtype)
        if step.decode_slots is not None:  # no host-side grouping: graph-capturable
            for s in self.slices:
                lora_per_token(xs, o2, s.a, s.b, s.scales, step.decode_slots, s.offset)
        elif step.uniform_slot is not None:
            self._uniform(xs, o2, step.uniform_slot)
        elif supports(xs) or xs.shape[0] > GATHER_MAX_TOKENS:
            for s in self.slices:
                segmented_lora(xs, o2, s.a, s.b, s.scales, step.segments, s.offset)
        else:
            self._dense(xs, o2, step.token_slots)
        return out

    def _uniform(self, xs, o2, slot: int) -> None:
        """One adapter for the whole step: no gather or scatter; each slice's delta is PEFT's
        ``lora_B(lora_A(x)) * scaling`` added to the base output. One shrink for every slice;
        a short step of a fused layer on the CPU expands every slice in one matmul over the
        block-diagonal ``b_t`` (the other slices' blocks are exact zeros), a long one per slice
        without those flops. Few ops: on a CPU a decode step's small matmuls cost their launch."""
        ops = self.operands[slot]
        if ops is None:
            return
        y = torch.mm(xs, ops.a_t)  # [T, sum r]
        if ops.b_t is not None and xs.shape[0] * ops.waste <= BLOCK_DIAG_WASTE_MAX:
            delta = torch.mm(y, ops.b_t)  # [T, out]
            if ops.scales is not None:
                delta.mul_(ops.scales)
            o2[:, self.first : self.last].add_(delta)
            return
        for first, r, b_t, scale, cols in ops.slices:
            delta = torch.mm(y[:, first : first + r], b_t)  # [T, size]
            if scale is not None:
                delta.mul_(scale)
            o2[:, cols].add_(delta)

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
        self.operands[slot] = self._operands(slot)

    def _operands(self, slot: int) -> SlotOperands | None:
        """``slot``'s ``SlotOperands`` from its slices' (just written) factors."""
        live = [(s, s.ranks[slot]) for s in self.slices if s.ranks[slot]]
        if not live:
            return None
        a_t = torch.cat([s.a[slot, :r] for s, r in live]).T  # [in, sum r]
        parts, first = [], 0
        for s, r in live:
            cols = slice(s.offset, s.offset + s.size)
            b, scale = s.b[slot, :, :r], s.scale_values[slot]
            if _power_of_two(scale):  # folded into B: the same bits, one op less per step
                b, scale = b * scale, None
            b_t = b.contiguous().T  # [r, size], PEFT's lora_B layout: its BLAS kernels
            parts.append((first, r, b_t, scale, cols))
            first += r
        out = self.last - self.first
        if len(live) == 1 and live[0][0].size == out:  # one slice: its own B, its scaling
            scale = parts[0][3]
            if scale is not None:
                scale = torch.tensor(scale, dtype=torch.float32, device=a_t.device)
            return SlotOperands(a_t, tuple(parts), parts[0][2], scale)
        if self.a_all.device.type != "cpu" or first * out > BLOCK_DIAG_MAX:
            return SlotOperands(a_t, tuple(parts), None, None)
        b_t = self.a_all.new_zeros(first, out)  # [sum r, out]
        scales = torch.zeros(out, dtype=torch.float32)
        for y0, r, b_s, scale, cols in parts:
            rows = slice(cols.start - self.first, cols.stop - self.first)
            b_t[y0 : y0 + r, rows] = b_s
            scales[rows] = 1.0 if scale is None else scale
        if all(p[3] is None for p in parts):
            scales = None
        zeros = first * out - sum(r * (cols.stop - cols.start) for _, r, _, _, cols in parts)
        return SlotOperands(a_t, tuple(parts), b_t, scales, zeros // max(1, len(parts) - 1))


def _power_of_two(scale: float) -> bool:
    """Whether ``(y @ B.T) * scale == y @ (scale * B).T`` bit for bit: scaling by a power of two
    is exact at every rounding of the sum (outside the subnormal range)."""
    return scale != 0 and math.frexp(abs(scale))[0] == 0.5


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
