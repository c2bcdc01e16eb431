"""Tensor parallelism for the generic path, from the model's own TP plan.

transformers names, per module or parameter, a parallel style (``config.base_model_tp_plan``
relative to the base model, the causal LM's ``_tp_plan`` for ``lm_head``). What each style does
here, with the collectives in this file's forwards:

| style | parameters on rank r | forward |
|---|---|---|
| colwise | rows (output features) shard r; KV projections with fewer heads than ranks keep the head rank r's query heads use | as is (output sharded) |
| packed_colwise | shard r of each packed half (gate / up) along the output dim | as is |
| rowwise | columns (input features) shard r; a Linear's bias on rank 0 only | Linear: all-reduce the output |
| moe_tp_experts | (its parameters are planned one by one) | all-reduce the output |
| colwise_gather_output, rowwise_split_input, colwise_rep, rowwise_rep, embedding_rowwise, embedding_colwise, replicate, replicated_with_grad_allreduce | replicated: their outputs are replicated either way | as is |

Any other style, a shape that does not split evenly, or a reduced module with an unplanned
parameter refuses tensor parallelism by name (``UnsupportedModelError``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from hf_paged.distributed.communicator import Communicator
from hf_paged.models.generic.fp8 import Fp8Linear, scale_shard_rule
from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.refusal import Refusal

_REPLICATED = {
    "colwise_gather_output", "rowwise_split_input", "colwise_rep", "rowwise_rep",
    "embedding_rowwise", "embedding_colwise", "replicate", "replicated_with_grad_allreduce",
}  # fmt: skip
_KV_NAMES = ("k_proj", "v_proj", "key", "value")


@dataclass(frozen=True)
class ShardRule:
    """How rank ``rank`` of ``world`` takes its part of one full checkpoint tensor."""

    dim: int  # the split dim (negative: from the end)
    rank: int
    world: int
    packed: int = 1  # >1: the dim holds this many packed parts, each split
    kv_heads: int | None = None  # KV projection with fewer heads than ranks: keep one head
    rank0_only: bool = False  # a rowwise bias: zeros on the other ranks

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        if self.rank0_only:
            return t if self.rank == 0 else torch.zeros_like(t)
        dim = self.dim % t.dim()
        if self.kv_heads is not None:  # [kv_heads * head_dim, ...]: the head for this rank
            head_dim = t.shape[dim] // self.kv_heads
            head = self.rank * self.kv_heads // self.world
            return t.narrow(dim, head * head_dim, head_dim).contiguous()
        parts = t.chunk(self.packed, dim=dim)
        return torch.cat([p.chunk(self.world, dim=dim)[self.rank] for p in parts], dim).contiguous()

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.apply(torch.empty(shape, device="meta")).shape)


def tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's TP plan with full module names (wildcards for layer numbers)."""
    plan: dict[str, str] = {}
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    for key, style in base.items():
        plan[f"{prefix}.{key}" if prefix else key] = style
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def _generic_name(name: str) -> str:
    return re.sub(r"\.\d+(\.|$)", lambda m: ".*" + m.group(1), name)


def apply_tp_plan(model: nn.Module, comm: Communicator) -> dict[str, ShardRule]:
    """Shard ``model`` (built on meta) for ``comm``'s rank: local-shape meta parameters, the
    collectives installed. Returns the rule per parameter name that the loader applies.

    Raises:
        UnsupportedModelError: a style or shape this path cannot split exactly.
    """
    plan = tp_plan(model)
    if not plan:
        raise UnsupportedModelError(f"{type(model).__name__} has no tensor-parallel plan")
    rules: dict[str, ShardRule] = {}
    kv_heads = getattr(model.config.get_text_config(), "num_key_value_heads", None)
    for name, module in model.named_modules():
        style = plan.get(_generic_name(name))
        for pname, param in module.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            pstyle = plan.get(_generic_name(full), style)
            if isinstance(module, Fp8Linear) and pname not in ("weight", "bias"):
                # an FP8 scale: split with the blocks of the weight it scales, or replicated
                weight_rule = _param_rule(f"{name}.weight", module.weight, pstyle, module, comm,
                                          kv_heads)  # fmt: skip
                rule = scale_shard_rule(module, pname, weight_rule, full)
            else:
                rule = _param_rule(full, param, pstyle, module, comm, kv_heads)
            if rule is not None:
                rules[full] = rule
        if style == "moe_tp_experts" or (style == "rowwise" and isinstance(module, nn.Linear)):
            unplanned = [
                p
                for p, _ in module.named_parameters()
                if f"{name}.{p}" not in rules and not _replicated_scale(module, p)
            ]
            if unplanned:
                raise UnsupportedModelError(
                    f"tensor parallelism: {name} is reduced over ranks but its {unplanned} "
                    "have no plan"
                )
            reduce_output(module, comm)
    for full, rule in rules.items():
        owner, _, leaf = full.rpartition(".")
        mod = model.get_submodule(owner)
        old = mod._parameters[leaf]
        local = torch.empty(rule.local_shape(tuple(old.shape)), dtype=old.dtype, device="meta")
        mod._parameters[leaf] = nn.Parameter(local, requires_grad=False)
    return rules


class _PlanOnly(Communicator):
    """Rank 0 of ``world`` without a process group: plans a split, never runs a collective."""

    def __init__(self, world: int):
        self.rank, self.world_size, self.group = 0, world, None


def tp_plan_refusal(model: nn.Module, world: int) -> Refusal | None:
    """Why ``apply_tp_plan`` would refuse ``model`` (built on meta; it is sharded in place, so
    pass a throwaway one) at ``world`` ranks, or None. Every rank plans the same splits."""
    try:
        apply_tp_plan(model, _PlanOnly(world))
    except UnsupportedModelError as e:
        return Refusal(
            "tensor_parallel_size",
            f"tensor_parallel_size={world} is not allowed for {type(model).__name__} on the "
            f"generic model path: {e}; tensor_parallel_size must be 1, or a size its TP plan "
            "splits evenly",
        )
    return None


def _replicated_scale(module: nn.Module, pname: str) -> bool:
    """An FP8 scale that every rank holds whole (``scale_shard_rule`` gave it no rule)."""
    cfg = getattr(module, "fp8_config", None)
    return cfg is not None and pname in (cfg.scale_name, cfg.input_scale_name)


def _param_rule(name, param, style, module, comm, kv_heads) -> ShardRule | None:
    rank, world = comm.rank, comm.world_size
    if style is None or style in _REPLICATED or style == "moe_tp_experts":
        return None
    nd = param.dim()
    if style == "colwise":
        dim = -1 if nd == 1 else nd - 2
        kv = _kv_rule(name, param, dim, kv_heads, rank, world)
        rule = kv or ShardRule(dim, rank, world)
    elif style == "packed_colwise":
        rule = ShardRule(-1 if nd == 1 else nd - 2, rank, world, packed=2)
    elif style == "rowwise":
        is_bias = nd == 1 and isinstance(module, nn.Linear)
        rule = ShardRule(-1, rank, world, rank0_only=is_bias)
    else:
        raise UnsupportedModelError(
            f"tensor parallelism: style {style!r} of {name} is not supported"
        )
    _check_even(name, param, rule)
    return rule


def _kv_rule(name, param, dim, kv_heads, rank, world) -> ShardRule | None:
    """KV projections with fewer heads than ranks: every rank keeps the head its queries use."""
    owner = name.rsplit(".", 2)[-2] if name.count(".") else name
    if owner not in _KV_NAMES or not kv_heads or kv_heads % world == 0:
        return None
    if world % kv_heads:
        raise UnsupportedModelError(
            f"tensor parallelism: {kv_heads} KV heads over {world} ranks neither split nor replicate"
        )
    return ShardRule(dim, rank, world, kv_heads=kv_heads)


def _check_even(name: str, param: torch.Tensor, rule: ShardRule) -> None:
    if rule.rank0_only or rule.kv_heads is not None:
        return
    size = param.shape[rule.dim % param.dim()]
    if size % (rule.world * rule.packed):
        raise UnsupportedModelError(
            f"tensor parallelism: {name} has {size} along dim {rule.dim}, not divisible by "
            f"{rule.world} ranks"
        )


_REDUCED_CLASSES: dict[type, type] = {}


def reduce_output(module: nn.Module, comm: Communicator) -> None:
    """Make ``module``'s forward all-reduce its output over the TP group (its class is swapped
    for a subclass; parameter names stay)."""
    cls = type(module)
    sub = _REDUCED_CLASSES.get(cls)
    if sub is None:

        def forward(self, *args, **kwargs):
            out = cls.forward(self, *args, **kwargs)
            if isinstance(out, tuple):  # (hidden, extras...): the hidden states are partial
                return (self._hf_paged_comm.all_reduce(out[0]), *out[1:])
            return self._hf_paged_comm.all_reduce(out)

        sub = type(f"AllReduced{cls.__name__}", (cls,), {"forward": forward})
        _REDUCED_CLASSES[cls] = sub
    module.__class__ = sub
    module.__dict__["_hf_paged_comm"] = comm
