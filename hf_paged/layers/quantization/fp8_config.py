"""Which quantized checkpoints the engine serves, read from a model's ``quantization_config``.

Two FP8 formats are served; both keep float8_e4m3fn weights with float32 scales that multiply
them back (``w = weight.float() * scale``):

| format | ``quant_method`` | weight scale | activations |
|---|---|---|---|
| transformers fine-grained FP8 (``FineGrainedFP8Config``) | ``"fp8"`` | ``weight_scale_inv`` ``[ceil(N/bn), ceil(K/bk)]`` for ``weight_block_size=[bn, bk]`` blocks (per tensor, a scalar, when the block size is null) | dynamic, per token in groups of ``bk`` |
| compressed-tensors FP8 ("-FP8", "-FP8-dynamic") | ``"compressed-tensors"`` | ``weight_scale`` ``[N, 1]`` (channel) or ``[1]`` (tensor) | dynamic per token, or static per tensor (``input_scale``) |

Everything else (other methods, int8/int4 compressed-tensors schemes, a KV-cache scheme, static
activations with block scales, UE8M0 scales) is not served: :func:`unserved_quantization` names
why, and the callers keep their named fallback to stock transformers. This module is the one
place that decides which methods are served.

A config that says FP8 over plain weights (``dequantize=True``: transformers dequantized it at
load) is plain weights.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FP8_METHODS = ("fp8", "compressed-tensors")  # the quant_method values parsed here


class UnsupportedQuantizationError(ValueError):
    """A ``quantization_config`` the engine does not serve; the message says why."""


@dataclass(frozen=True)
class Fp8Config:
    """One served FP8 scheme (see the module table).

    Attributes:
        method: the config's ``quant_method``: "fp8" or "compressed-tensors".
        strategy: "block" (``block`` scales), "channel" ([N, 1]) or "tensor" (one scale).
        block: ``(bn, bk)`` for block scales, else None.
        dynamic: activations quantized per token (per group of ``bk`` with blocks) at run time;
            False = one static per-tensor ``input_scale``.
        scale_name: the weight scale's checkpoint name ("weight_scale_inv" / "weight_scale").
        input_scale_name: the static activation scale's name, or None when dynamic.
        skip: module names / patterns left unquantized (``modules_to_not_convert`` or
            compressed-tensors' ``ignore``); None = transformers' default (the output head).
        regex_prefix: compressed-tensors marks regex patterns with "re:"; transformers' patterns
            are all regexes anchored at module boundaries.
    """

    method: str
    strategy: str
    block: tuple[int, int] | None
    dynamic: bool
    scale_name: str
    input_scale_name: str | None
    skip: tuple[str, ...] | None
    regex_prefix: bool = False

    def converts(self, module_name: str) -> bool:
        """Whether the linear layer ``module_name`` (HF's full name) is FP8 in the checkpoint."""
        if self.skip is None:  # transformers' default: the output head stays unquantized
            return not module_name.split(".")[-1] == "lm_head"
        if self.regex_prefix:
            return not any(_ct_match(p, module_name) for p in self.skip)
        return _hf_converts(module_name, self.skip)


def _ct_match(pattern: str, name: str) -> bool:
    """compressed-tensors' rule: "re:<regex>" matches from the start, else the exact name or
    its last component."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return name == pattern or name.endswith("." + pattern)


def _hf_converts(name: str, patterns: tuple[str, ...]) -> bool:
    """transformers' ``should_convert_module``: a pattern skips ``name`` when it matches from the
    start up to a module boundary (as a regex) or as a suffix."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return not any(re.match(rf"(?:{p}){boundary}", name) or name.endswith(p) for p in patterns)


def quantization_dict(model_or_config) -> dict | None:
    """The ``quantization_config`` of a model, config or dict as a plain dict, or None."""
    if isinstance(model_or_config, dict):
        return model_or_config
    quantizer = getattr(model_or_config, "hf_quantizer", None)
    qc = getattr(quantizer, "quantization_config", None)
    if qc is None:
        config = getattr(model_or_config, "config", model_or_config)
        qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    if isinstance(qc, dict):
        return qc
    to_dict = getattr(qc, "to_dict", None)
    d = to_dict() if callable(to_dict) else dict(vars(qc))
    method = getattr(qc, "quant_method", d.get("quant_method"))
    d["quant_method"] = getattr(method, "value", method)  # transformers' enum
    return d


def method_of(qc: dict) -> str:
    method = qc.get("quant_method")
    method = getattr(method, "value", method)
    return str(method) if method else "unknown"


def parse_fp8(qc: dict) -> Fp8Config | None:
    """The served scheme of a ``quantization_config`` dict; None when it leaves the weights
    plain (``dequantize=True``).

    Raises:
        UnsupportedQuantizationError: any method or scheme not served, naming what it has.
    """
    method = method_of(qc)
    if method == "fp8":
        return _parse_transformers_fp8(qc)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(qc)
    raise UnsupportedQuantizationError(
        f"quant_method={method!r} is not served: the engine runs FP8 checkpoints "
        f"(quant_method one of {list(FP8_METHODS)}) and unquantized weights"
    )


def _parse_transformers_fp8(qc: dict) -> Fp8Config | None:
    if qc.get("dequantize"):
        return None
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    fmt = qc.get("scale_fmt", "float") or "float"
    if fmt != "float":
        raise UnsupportedQuantizationError(
            f"quant_method='fp8' with scale_fmt={fmt!r} is not served: only 'float' scales"
        )
    if qc.get("modules_to_convert"):
        raise UnsupportedQuantizationError(
            "quant_method='fp8' with modules_to_convert (FP8 embeddings) is not served"
        )
    block = qc.get(
        "weight_block_size", (128, 128)
    )  # FineGrainedFP8Config's default; null: per tensor
    if block is not None:
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise UnsupportedQuantizationError(
                f"quant_method='fp8' with weight_block_size={block!r} is not served: must be "
                "two positive ints"
            )
        if scheme != "dynamic":
            raise UnsupportedQuantizationError(
                f"quant_method='fp8' with activation_scheme={scheme!r} and block scales is not "
                "served: only 'dynamic' activations with weight_block_size"
            )
    if scheme not in ("dynamic", "static"):
        raise UnsupportedQuantizationError(f"activation_scheme={scheme!r} is not served")
    skip = qc.get("modules_to_not_convert")
    if skip is None and qc.get("ignored_layers") is not None:
        skip = qc["ignored_layers"]
    return Fp8Config(
        method="fp8",
        strategy="block" if block is not None else "tensor",
        block=tuple(block) if block is not None else None,
        dynamic=scheme == "dynamic",
        scale_name="weight_scale_inv",
        input_scale_name=None if scheme == "dynamic" else "activation_scale",
        skip=tuple(skip) if skip is not None else None,
    )


def _ct_args_reason(what: str, args: dict | None) -> str | None:
    if args is None:
        return f"no {what}"
    if args.get("type") != "float" or args.get("num_bits") != 8:
        return f"{what} of type={args.get('type')!r}, num_bits={args.get('num_bits')!r}"
    if args.get("symmetric") is False:
        return f"asymmetric {what}"
    return None


def _parse_compressed_tensors(qc: dict) -> Fp8Config:
    def refuse(why: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(
            f"quant_method='compressed-tensors' with {why} is not served: the engine runs its "
            "FP8 schemes (8-bit float weights per channel or tensor, 8-bit float activations "
            "dynamic per token or static per tensor)"
        )

    if qc.get("kv_cache_scheme"):
        raise refuse(f"kv_cache_scheme={qc['kv_cache_scheme']!r}")
    fmt = qc.get("format")
    if fmt not in (None, "float-quantized", "naive-quantized"):
        raise refuse(f"format={fmt!r}")
    status = qc.get("quantization_status")
    if status not in (None, "compressed", "frozen"):
        raise refuse(f"quantization_status={status!r}")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise refuse(f"{len(groups)} config_groups (exactly one is served)")
    (group,) = groups.values()
    if "Linear" not in (group.get("targets") or []):
        raise refuse(f"targets={group.get('targets')!r} (must include 'Linear')")
    if group.get("output_activations"):
        raise refuse("output_activations")
    weights, acts = group.get("weights"), group.get("input_activations")
    for what, args in (("weights", weights), ("input_activations", acts)):
        why = _ct_args_reason(what, args)
        if why is not None:
            raise refuse(why)
    w_strategy = weights.get("strategy")
    if w_strategy not in ("channel", "tensor") or weights.get("dynamic"):
        raise refuse(f"weights strategy={w_strategy!r}, dynamic={weights.get('dynamic')!r}")
    a_strategy, dynamic = acts.get("strategy"), acts.get("dynamic")
    if not (
        (a_strategy == "token" and dynamic is True) or (a_strategy == "tensor" and not dynamic)
    ):
        raise refuse(f"input_activations strategy={a_strategy!r}, dynamic={dynamic!r}")
    return Fp8Config(
        method="compressed-tensors",
        strategy=w_strategy,
        block=None,
        dynamic=bool(dynamic),
        scale_name="weight_scale",
        input_scale_name=None if dynamic else "input_scale",
        skip=tuple(qc.get("ignore") or ()),
        regex_prefix=True,
    )


def unserved_quantization(model_or_config) -> tuple[str, str] | None:
    """``(method, why)`` when the model or config is quantized in a way the engine does not
    serve, else None (plain weights, or a served FP8 scheme)."""
    qc = quantization_dict(model_or_config)
    if qc is None:
        if getattr(model_or_config, "is_quantized", False):
            return "unknown", "the model is quantized (is_quantized) but names no method"
        return None
    try:
        fp8_config_of(model_or_config)
    except UnsupportedQuantizationError as e:
        return method_of(qc), str(e)
    return None


def fp8_config_of(model_or_config) -> Fp8Config | None:
    """The served FP8 scheme of a model or config, or None for plain weights.

    Raises:
        UnsupportedQuantizationError: a quantization the engine does not serve.
    """
    qc = quantization_dict(model_or_config)
    cfg = None if qc is None else parse_fp8(qc)
    params = getattr(model_or_config, "parameters", None)
    if cfg is not None and callable(params) and not any(_is_fp8(p) for p in params()):
        return None  # an in-memory model whose weights were dequantized (or never quantized)
    return cfg


def _is_fp8(t) -> bool:
    return str(t.dtype).startswith("torch.float8")


def layer_quant(config: Fp8Config | None, hf_names: list[str]) -> Fp8Config | None:
    """The scheme of one native linear layer fusing the HF modules ``hf_names`` (full names,
    e.g. ``model.layers.0.self_attn.q_proj``), or None when they are unquantized.

    Raises:
        UnsupportedQuantizationError: some of the fused modules are FP8 and others are not.
    """
    if config is None:
        return None
    converted = [config.converts(n) for n in hf_names]
    if all(converted):
        return config
    if not any(converted):
        return None
    raise UnsupportedQuantizationError(
        f"the fused modules {hf_names} are partly FP8 ({converted}); the engine fuses them into "
        "one layer and needs all or none quantized"
    )


SCALE_NAMES = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")


def plain_fp8_modules(model) -> list[str]:
    """Modules of an in-memory model holding FP8 weight scales over a plain weight (a weight
    transformers' quantizer's blocks do not divide, left unquantized; a head tied to the
    embeddings): its ``FP8Linear`` computes plainly with such a weight, the scales unused."""
    names = []
    for name, module in model.named_modules():
        weight = module._parameters.get("weight")
        scaled = any(s in module._parameters for s in ("weight_scale_inv", "weight_scale"))
        if scaled and weight is not None and not _is_fp8(weight):
            names.append(name)
    return names


def with_plain_modules(model):
    """The config the engine builds an in-memory FP8 model from: its own, with the modules
    :func:`plain_fp8_modules` finds added to the skip list (``modules_to_not_convert``, or
    ``ignore`` for compressed-tensors), so they are built and loaded as plain linears."""
    import copy

    names = plain_fp8_modules(model)
    if not names:
        return model.config
    qc = dict(quantization_dict(model))
    if method_of(qc) == "fp8":
        key = "modules_to_not_convert"
        quantizer = getattr(model, "hf_quantizer", None)  # the skip list it resolved
        base = getattr(quantizer, "modules_to_not_convert", None) or qc.get(key) or ["lm_head"]
    else:
        key, base = "ignore", qc.get("ignore") or []
    qc[key] = list(base) + names
    config = copy.deepcopy(model.config)
    config.quantization_config = qc
    return config


def fp8_param_names(model) -> set[str]:
    """Names of an in-memory model's float8 weights and their scales (their dtypes are not the
    model's compute dtype)."""
    names = set()
    for name, p in model.named_parameters():
        if _is_fp8(p) or name.rsplit(".", 1)[-1] in SCALE_NAMES:
            names.add(name)
    return names
