"""Speed rewrites of a loaded generic model, applied on CUDA (numerics of a fused GEMM differ
from three separate ones in the last bits, as on the native path).

* q/k/v and gate/up: sibling ``nn.Linear`` modules named ``q_proj, k_proj, v_proj`` (or
  ``gate_proj, up_proj``) that read the same input share one concatenated weight; the first
  called runs one GEMM and the others return their slice of its output. Each member's weight
  becomes a view of the fused one (no second copy). A member called on another tensor than the
  group's first (a model that does not call them on one input) computes with its own view, so
  the result is always the unfused one.
* every other plain ``nn.Linear`` runs through ``kernels.skinny_gemm.linear`` (the native
  path's decode GEMM for a few rows, ``F.linear`` otherwise).
* RMSNorm modules whose ``forward`` is Llama's, line for line (most decoders copy it), run the
  native path's one-launch RMSNorm kernel (``kernels.fused_norm``, identical math).
* MLP modules whose ``forward`` is Llama's (``down(act(gate(x)) * up(x))``) with a SiLU
  activation and a fused gate/up group run the fused GEMM's ``[gate | up]`` output through the
  native path's ``silu_and_mul`` kernel (one launch instead of two, same rounding).

Modules change class (subclasses of ``nn.Linear``), never name: parameter names stay HF's.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn

from hf_paged.kernels import fused_act, fused_norm
from hf_paged.kernels.skinny_gemm import linear

_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _linear_nd(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """[..., in] -> [..., out] through the 2-D ``linear``."""
    out = linear(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


class PagedLinear(nn.Linear):
    """An HF ``nn.Linear`` whose GEMM is hf_paged's (same parameters)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear_nd(x, self.weight, self.bias)


class _FusedGroup:
    """One GEMM for sibling projections: ``weight`` [sum(out_i), in], ``offsets`` of each."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias = weight, bias
        self.offsets = [0]
        for s in sizes:
            self.offsets.append(self.offsets[-1] + s)
        self.key: torch.Tensor | None = None  # the input of the pending fused output
        self.out: torch.Tensor | None = None


class FusedMemberLinear(nn.Linear):
    """Member ``_hf_paged_index`` of a ``_FusedGroup`` (see the module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, i = self._hf_paged_group, self._hf_paged_index
        if i == 0:
            g.key, g.out = x, _linear_nd(x, g.weight, g.bias)
        elif g.key is not x:  # not the group's input: compute this projection alone
            return _linear_nd(x, self.weight, self.bias)
        out = g.out[..., g.offsets[i] : g.offsets[i + 1]]
        if i == len(g.offsets) - 2:
            g.key = g.out = None  # the last member: drop the activations
        return out


@functools.cache
def _llama_rms_norm_forward(cls: type) -> bool:
    """``cls.forward`` is LlamaRMSNorm's (same source text)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    try:
        return inspect.getsource(cls.forward) == inspect.getsource(LlamaRMSNorm.forward)
    except (OSError, TypeError):
        return False


_NORM_CLASSES: dict[type, type] = {}


def _swap_rms_norm(module: nn.Module) -> bool:
    cls = type(module)
    w = getattr(module, "weight", None)
    if not (isinstance(w, torch.Tensor) and w.dim() == 1 and hasattr(module, "variance_epsilon")):
        return False
    if cls in _NORM_CLASSES.values() or not _llama_rms_norm_forward(cls):
        return False
    sub = _NORM_CLASSES.get(cls)
    if sub is None:

        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            if fused_norm.supports(hidden_states, self.weight):
                return fused_norm.rms_norm(hidden_states, self.weight, self.variance_epsilon)
            return cls.forward(self, hidden_states)

        sub = type(f"Paged{cls.__name__}", (cls,), {"forward": forward})
        _NORM_CLASSES[cls] = sub
    module.__class__ = sub
    return True


_MLP_CLASSES: dict[type, type] = {}


@functools.cache
def _llama_mlp_forward(cls: type) -> bool:
    from transformers.models.llama.modeling_llama import LlamaMLP

    from hf_paged.models.generic.rope import code_body

    mine = code_body(cls.forward)
    return mine is not None and mine == code_body(LlamaMLP.forward)


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    if not isinstance(act, nn.Module):  # a plain function, or no act_fn at all
        return False
    try:  # transformers' SiLUActivation: ``return nn.functional.silu(input)``
        src = inspect.getsource(type(act).forward)
    except (OSError, TypeError):
        return False
    return type(act).__name__ == "SiLUActivation" and src.strip().endswith("functional.silu(input)")


def _swap_mlp(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if not (isinstance(gate, FusedMemberLinear) and isinstance(up, FusedMemberLinear)):
        return False
    group, i = gate._hf_paged_group, gate.out_features
    if up._hf_paged_group is not group or group.offsets != [0, i, 2 * i]:
        return False
    cls = type(module)
    if not (_is_silu(getattr(module, "act_fn", None)) and _llama_mlp_forward(cls)):
        return False
    sub = _MLP_CLASSES.get(cls)
    if sub is None:

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            g = self.gate_proj._hf_paged_group
            gate_up = _linear_nd(x, g.weight, g.bias)  # [..., 2I]
            if fused_act.supports(gate_up):
                return self.down_proj(fused_act.silu_and_mul(gate_up))
            i = self.gate_proj.out_features
            return self.down_proj(self.act_fn(gate_up[..., :i]) * gate_up[..., i:])

        sub = type(f"Paged{cls.__name__}", (cls,), {"forward": forward})
        _MLP_CLASSES[cls] = sub
    module.__class__ = sub
    return True


def _fuse(members: list[nn.Linear]) -> bool:
    ws = [m.weight for m in members]
    has_bias = [m.bias is not None for m in members]
    if any(has_bias) and not all(has_bias):
        return False
    if len({(w.shape[1], w.dtype, w.device) for w in ws}) != 1:
        return False
    weight = torch.cat([w.detach() for w in ws])
    bias = torch.cat([m.bias.detach() for m in members]) if all(has_bias) else None
    group = _FusedGroup(weight, bias, [w.shape[0] for w in ws])
    for i, m in enumerate(members):
        a, b = group.offsets[i], group.offsets[i + 1]
        m.weight = nn.Parameter(weight[a:b], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[a:b], requires_grad=False)
        m.__class__ = FusedMemberLinear
        m.__dict__["_hf_paged_group"], m.__dict__["_hf_paged_index"] = group, i
    return True


@torch.no_grad()
def apply_fusions(model: nn.Module) -> dict[str, int]:
    """Rewrite ``model`` in place; returns how many groups and linears were rewritten."""
    fused = 0
    for module in model.modules():
        for names in _GROUPS:
            members = [getattr(module, n, None) for n in names]
            if all(type(m) is nn.Linear for m in members) and _fuse(members):
                fused += 1
    swapped = norms = mlps = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PagedLinear
            swapped += 1
        elif _swap_rms_norm(module):
            norms += 1
        elif _swap_mlp(module):
            mlps += 1
    return {"fused_groups": fused, "paged_linears": swapped, "paged_rms_norms": norms,
            "silu_and_mul_mlps": mlps}  # fmt: skip
