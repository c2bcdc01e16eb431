"""FP8 layers for the generic model path (HF's own modules).

:func:`install_fp8_linears` swaps, in an HF model built on meta, every ``nn.Linear`` the
checkpoint quantized for an :class:`Fp8Linear` (an ``nn.Linear`` subclass, so the model's code
and TP plan see a linear; parameter names are the checkpoint's): float8 ``weight``, the fp32
scale under its checkpoint name, the static input scale when there is one. Which modules:
transformers' rule for its own format (``should_convert_module`` over
``modules_to_not_convert``, or its default skips: the output head), compressed-tensors'
``ignore`` list for that one. An in-memory transformers FP8 model (its ``FP8Linear``) has the
same parameter names, so it loads by name like any model.

:func:`scale_shard_rule` gives the TP plan's rule for a scale: block scales split with their
blocks (dims 0 / 1 as the weight's, by blocks), row scales with the rows, per-tensor and
row-parallel row scales are replicated (a per-tensor scale by its config strategy: the meta
module holds an ``[out, 1]`` placeholder); a split that cuts a block is refused by name.
"""

from __future__ import annotations

import torch
from torch import nn

from hf_paged.layers.quantization.fp8_config import Fp8Config
from hf_paged.layers.quantization.fp8_linear import FP8_DTYPE, fp8_linear


class Fp8Linear(nn.Linear):
    """An HF linear with float8 weights (see the module docstring)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: Fp8Config,
                 dtype: torch.dtype):  # fmt: skip
        nn.Module.__init__(self)
        self.in_features, self.out_features = in_features, out_features
        self.fp8_config = config

        def empty(*shape, dtype=torch.float32):
            return nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"), False)

        self.weight = empty(out_features, in_features, dtype=FP8_DTYPE)
        if config.block is not None:
            bn, bk = config.block
            shape = (-(-out_features // bn), -(-in_features // bk))
        else:
            shape = (out_features, 1)
        self.register_parameter(config.scale_name, empty(*shape))
        if config.input_scale_name is not None:
            self.register_parameter(config.input_scale_name, empty(1))
        if bias:
            self.bias = empty(out_features, dtype=dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        cfg = self.fp8_config
        out = self.weight.shape[0]  # this rank's rows (``out_features`` is the full count)
        scale = getattr(self, cfg.scale_name)
        if cfg.block is None and scale.numel() == 1:  # per tensor ([], [1], [1, 1]): every row
            scale = scale.reshape(1, 1).expand(out, 1)
        inp = getattr(self, cfg.input_scale_name) if cfg.input_scale_name else None
        y = fp8_linear(x.reshape(-1, x.shape[-1]), self.weight, scale, cfg.block, inp, self.bias)
        return y.view(*x.shape[:-1], out)

    def extra_repr(self) -> str:
        cfg = self.fp8_config
        return f"{super().extra_repr()}, fp8={cfg.strategy}, block={cfg.block}"


def _skip_list(model: nn.Module, config: Fp8Config) -> list[str] | None:
    """transformers' skip list for its own format, as its quantizer builds it."""
    if config.method != "fp8":
        return None
    from transformers.quantizers.base import get_keys_to_not_convert

    skip = list(config.skip) if config.skip is not None else get_keys_to_not_convert(model)
    return skip + list(getattr(model, "_keep_in_fp32_modules", None) or [])


def _tied_head(model: nn.Module) -> nn.Module | None:
    """The output head when it shares the input embeddings' weight, else None. A tied head is
    the plain embedding table whatever the quantization config says: transformers' FP8Linear
    then holds that table and computes with it unscaled."""
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    embed = get_in() if callable(get_in) else None
    if head is None or embed is None:
        return None
    return head if getattr(head, "weight", None) is getattr(embed, "weight", 0) else None


def install_fp8_linears(model: nn.Module, config: Fp8Config | None) -> int:
    """Swap the quantized ``nn.Linear`` modules of a meta-built HF model for
    :class:`Fp8Linear`; returns how many. ``config`` None: nothing to do."""
    if config is None:
        return 0
    skip = _skip_list(model, config)
    if config.method == "fp8":
        from transformers.quantizers.quantizers_utils import should_convert_module

        def converts(name):
            return should_convert_module(name, skip)
    else:
        converts = config.converts
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tied = _tied_head(model)
    swapped = 0
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module is tied or not converts(name):
            continue
        new = Fp8Linear(module.in_features, module.out_features, module.bias is not None, config,
                        dtype)  # fmt: skip
        model.set_submodule(name, new)
        swapped += 1
    return swapped


def scale_shard_rule(module: nn.Module, pname: str, rule, name: str):
    """The shard rule of the scale ``pname`` of ``module`` given its weight's rule
    (``models.generic.tp.ShardRule``, or None when the weight is replicated); None =
    replicated.

    Raises:
        UnsupportedModelError: the split cuts a scale block (names ``name`` and the sizes).
    """
    from hf_paged.models.protocol import UnsupportedModelError

    cfg = module.fp8_config
    if rule is None or pname == cfg.input_scale_name or rule.rank0_only:
        return None
    if cfg.strategy == "tensor":
        # one scale for the whole weight, every rank: the checkpoint's is [], [1] or [1, 1],
        # not the [out, 1] placeholder the meta module holds
        return None
    dim = rule.dim % 2  # 0: split rows (colwise), 1: split columns (rowwise)
    if cfg.block is None:
        return rule if dim == 0 else None  # row scales follow rows; whole outputs on each rank
    b = cfg.block[dim]
    size = (module.out_features, module.in_features)[dim]
    if rule.kv_heads is not None:
        per_rank = size // rule.kv_heads
    else:
        per_rank = size // (rule.world * rule.packed)
    if per_rank % b:
        raise UnsupportedModelError(
            f"tensor parallelism: {name} has {per_rank} {('rows', 'columns')[dim]} per rank, not "
            f"a multiple of weight_block_size[{dim}]={b} (an FP8 scale block would be cut)"
        )
    return rule
