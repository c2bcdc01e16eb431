"""User-facing configuration: EngineConfig (how the engine runs) and SamplingParams (per request).

Both are frozen and validated at construction. An unknown key (to the constructor or
``from_dict``) raises ``TypeError`` naming it, suggesting the nearest valid key and listing the
allowed keys; a bad value raises ``ValueError`` naming the key, the value and what is
allowed. Values derived at run time (KV block count, EOS ids) never go back into these objects:
they live in ``engine.runtime.RuntimeInfo``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from dataclasses import dataclass, field, fields
from typing import Any

_DTYPES = ("auto", "float32", "float16", "bfloat16")
_MODEL_IMPLS = ("auto", "native", "generic")  # as hf_paged.models.registry.MODEL_IMPLS
_KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def _bad(name: str, value: Any, allowed: str) -> ValueError:
    return ValueError(f"{name}={value!r} is not allowed: {name} must be {allowed}")


def _check_int(name: str, value: Any, lo: int | None = None, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, "an int" + ("" if lo is None else f" >= {lo}"))
    if lo is not None and value < lo:
        raise _bad(name, value, f"an int >= {lo}")


def _check_seed(name: str, value: Any, num_streams: int, allow_none: bool = False) -> None:
    """A seed for ``num_streams`` generators seeded ``value``, ``value + 1``, ...: each must be
    what ``torch.Generator.manual_seed`` takes, [-2**63, 2**64 - 1]."""
    _check_int(name, value, allow_none=allow_none)
    if value is not None and not -(2**63) <= value <= 2**64 - num_streams:
        raise _bad(name, value, f"an int in [-2**63, 2**64 - {num_streams}]")


def _check_float(name: str, value: Any, lo: float, hi: float, lo_open=False, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, "a number")
    ok_lo = value > lo if lo_open else value >= lo
    ok_hi = value < hi if hi_open else value <= hi
    if not (ok_lo and ok_hi):
        lb, hb = ("(" if lo_open else "["), (")" if hi_open else "]")
        raise _bad(name, value, f"in {lb}{lo}, {hi}{hb}")


@functools.cache
def _init_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls) if f.init)


def _check_keys(cls, kwargs: dict[str, Any]) -> None:
    """TypeError for keys of ``kwargs`` that are no field of ``cls``: each with the nearest
    valid key ("max_num_seq -> did you mean max_num_seqs?"), then the allowed keys."""
    allowed = _init_names(cls)
    if kwargs.keys() <= allowed:
        return
    unknown, allowed = sorted(kwargs.keys() - allowed, key=str), sorted(allowed)
    hints = []
    for key in unknown:
        near = difflib.get_close_matches(str(key), allowed, n=1)
        if near:
            hints.append(f"{key} -> did you mean {near[0]}?")
    hint = f" ({'; '.join(hints)})" if hints else ""
    raise TypeError(
        f"{cls.__name__} got unknown key(s) {unknown}{hint}; allowed keys are {allowed}"
    )


def _checked_init(cls):
    """Class decorator: the dataclass constructor rejects unknown keywords with
    :func:`_check_keys`'s message instead of Python's bare "unexpected keyword argument"."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        _check_keys(cls, kwargs)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


def _from_kwargs(cls, kwargs: dict[str, Any]):
    """Build ``cls`` from a dict (unknown keys: see :func:`_check_keys`)."""
    _check_keys(cls, kwargs)
    return cls(**kwargs)


@_checked_init
@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Build with keywords or ``EngineConfig.from_dict``.

    Attributes:
        max_num_seqs: most sequences in one step (decode batch size).
        max_num_batched_tokens: most tokens (prefill chunks + decodes) in one step.
        max_model_len: longest sequence (prompt + output); None = the model's
            ``max_position_embeddings``.
        kv_block_size: tokens per KV-cache block.
        num_kv_blocks: fixed number of KV blocks; None = size from memory.
        kv_cache_bytes: byte budget for the KV cache (all layers, K and V). Used on CPU and on
            GPU when given; None on GPU = size from ``gpu_memory_utilization``; None on CPU =
            room for 8 times ``max_num_seqs`` sequences of ``max_model_len`` tokens (the
            prefix cache keeps earlier calls' blocks), at most 512 MiB
            (its pages are zero pages until a block is written: memory follows the work).
        gpu_memory_utilization: the engine's share of the GPU's memory, everything it holds
            (weights, activations, KV cache, CUDA graphs); refused, naming who holds the
            memory, when that share is not free. None (default): 0.9 of the GPU less what is in
            use beside it (a model already on the GPU, other engines), so the drop-in path
            works beside the HF model it serves and 0.1 of the GPU stays free.
        tensor_parallel_size: number of ranks (processes) the model is split over.
        enforce_eager: never capture CUDA graphs.
        dtype: weights and activations; "auto" = the checkpoint's dtype (fp32 on CPU for fp16).
        device: "cpu", "cuda" or "cuda:N"; None = cuda if available else cpu.
        enable_prefix_caching: reuse KV blocks of identical prefixes across requests.
        seed: seed of the engine's generator for requests without their own seed.
        attention_backend: None = chosen by capability; else a registered name ("torch", ...).
        async_scheduling: schedule and launch step n+1 before step n's tokens reach the host
            (one rank only; requests with penalties, logprobs or external sampling step
            synchronously). See ``engine/overlap.py``. None (default) = on for a single-rank
            CUDA engine (it hides the host's step work behind the GPU's), off on CPU and with
            TP.
        model_impl: which model path runs the model: "native" (our decoders), "generic" (HF's
            own modules with our attention) or "auto" (native when the architecture has a
            native implementation, else generic).
        tp_heartbeat_timeout_s: with tensor_parallel_size > 1, seconds a worker may go without a
            heartbeat (its process stopped or wedged) before it is killed and the pending call
            raises ``EngineDeadError``; None = never. Default 45 (a stuck worker is reported
            within a minute; a long Triton compile, which holds the GIL, is not mistaken for one).
        kv_cache_dtype: "auto" (the model dtype) or "fp8" / "fp8_e4m3": K and V stored as
            float8_e4m3fn (half the bytes of bf16, so twice the tokens), with a per-layer scale
            of 1.0 (values clamped to +-448); attention reads them back in the model dtype.
        encoder_cache_rows: vision-language models: most embedding rows of image features kept
            for reuse (keyed by the image's content hash; least recently used evicted first).
        enable_lora: build LoRA slots for adapters given per request (``LLM``'s
            ``lora_request``, ``LLMEngine.add_lora``). An in-memory PEFT model gets them
            without it (``models/adapters``).
        max_loras: distinct LoRA adapters in one step (device slots in every adapted layer).
        max_lora_rank: the slots' rank; an adapter of higher rank is refused, naming it.
        max_cpu_loras: registered adapters kept on the host (least recently used evicted);
            None = ``max(max_loras, 16)``.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    dtype: str = "auto"
    device: str | None = None
    enable_prefix_caching: bool = True
    seed: int = 0
    attention_backend: str | None = None
    async_scheduling: bool | None = None
    model_impl: str = "auto"
    tp_heartbeat_timeout_s: float | None = 45.0
    kv_cache_dtype: str = "auto"
    encoder_cache_rows: int = 16384
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1, allow_none=True)
        _check_int("kv_block_size", self.kv_block_size, 1)
        _check_int("num_kv_blocks", self.num_kv_blocks, 1, allow_none=True)
        _check_int("kv_cache_bytes", self.kv_cache_bytes, 1, allow_none=True)
        if self.gpu_memory_utilization is not None:
            _check_float("gpu_memory_utilization", self.gpu_memory_utilization, 0.0, 1.0,
                         lo_open=True)  # fmt: skip
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("encoder_cache_rows", self.encoder_cache_rows, 0)
        _check_seed("seed", self.seed, 2)  # the sampler's generator and the proposers' (+1)
        if not isinstance(self.enforce_eager, bool):
            raise _bad("enforce_eager", self.enforce_eager, "a bool")
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise _bad("async_scheduling", self.async_scheduling, "a bool or None")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise _bad(
                "async_scheduling",
                True,
                f"False with tensor_parallel_size={self.tensor_parallel_size}",
            )
        if self.tp_heartbeat_timeout_s is not None:
            _check_float("tp_heartbeat_timeout_s", self.tp_heartbeat_timeout_s, 0.0, 1e9, True)
        if not isinstance(self.enable_prefix_caching, bool):
            raise _bad("enable_prefix_caching", self.enable_prefix_caching, "a bool")
        if self.dtype not in _DTYPES:
            raise _bad("dtype", self.dtype, f"one of {list(_DTYPES)}")
        if self.device is not None:
            dev = self.device
            ok = isinstance(dev, str) and (
                dev in ("cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())
            )
            if not ok:
                raise _bad("device", dev, "None, 'cpu', 'cuda' or 'cuda:N'")
        if self.kv_cache_dtype not in _KV_CACHE_DTYPES:
            raise _bad("kv_cache_dtype", self.kv_cache_dtype, f"one of {list(_KV_CACHE_DTYPES)}")
        if self.model_impl not in _MODEL_IMPLS:
            raise _bad("model_impl", self.model_impl, f"one of {list(_MODEL_IMPLS)}")
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise _bad("attention_backend", self.attention_backend, "None or a backend name")
        if not isinstance(self.enable_lora, bool):
            raise _bad("enable_lora", self.enable_lora, "a bool")
        _check_int("max_loras", self.max_loras, 1)
        _check_int("max_lora_rank", self.max_lora_rank, 1)
        _check_int("max_cpu_loras", self.max_cpu_loras, self.max_loras, allow_none=True)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | EngineConfig | None = None, **overrides) -> EngineConfig:
        """An EngineConfig from a dict (or a copy of one with ``overrides``)."""
        if isinstance(d, EngineConfig):
            return dataclasses.replace(d, **overrides) if overrides else d
        return _from_kwargs(cls, {**(d or {}), **overrides})


@_checked_init
@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM's names and meanings).

    Attributes:
        n: completions per prompt (they share the prompt's KV blocks).
        temperature: 0 = greedy.
        top_k: keep the k most likely tokens; -1 (or 0) = all.
        top_p: nucleus mass in (0, 1]; 1 = off.
        min_p: drop tokens below min_p * p(max); 0 = off.
        repetition_penalty: HF/CTRL penalty on every token already in prompt or output; 1 = off.
        presence_penalty: subtracted once from logits of tokens in the output; 0 = off.
        frequency_penalty: subtracted per occurrence in the output; 0 = off.
        max_tokens: most new tokens; None = up to ``max_model_len`` (as vLLM).
        min_tokens: stop tokens (EOS and ``stop_token_ids``) are masked until this many.
        stop_token_ids: extra ids that end the request (beside the model's EOS ids).
        stop: stop strings (HF ``stop_strings`` semantics: the request stops as soon as one
            overlaps the newest token; it stays in the output). Needs a tokenizer; such
            requests step synchronously.
        ignore_eos: do not stop at EOS ids (``stop_token_ids`` still stop).
        seed: per-request seed; the same seed gives the same tokens whatever the batch.
        logprobs: None = none; k >= 0 = the sampled token's logprob and the top k (a k past
            the vocabulary gives all of it).
        prompt_logprobs: None = none; k >= 0 = per prompt token, its logprob under the model
            given the tokens before it and the top k, as ``logprobs``
            (``RequestOutput.prompt_logprobs``).
        prompt_logprobs_next: also score this token id as the one after the prompt (from the
            last prompt position's logits; hf_paged's extension): lm-eval's loglikelihood scores
            a continuation's last token without a position of its own. Needs prompt_logprobs;
            its entry is appended to ``RequestOutput.prompt_logprobs``.
        prompt_logprobs_start: first prompt position scored (>= 1; hf_paged's extension):
            earlier entries are None and their KV may come from the prefix cache.
        skip_special_tokens: drop special tokens when detokenizing ``.text``.
    """

    n: int = 1
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 1
    prompt_logprobs_next: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1)
        _check_float("temperature", self.temperature, 0.0, float("inf"), hi_open=True)
        _check_int("top_k", self.top_k, -1)
        _check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.0, float("inf"), True, True)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_int("max_tokens", self.max_tokens, 1, allow_none=True)
        _check_int("min_tokens", self.min_tokens, 0)
        _check_seed("seed", self.seed, self.n, allow_none=True)  # seed + i for completion i
        _check_int("logprobs", self.logprobs, 0, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, 0, allow_none=True)
        _check_int("prompt_logprobs_start", self.prompt_logprobs_start, 1)
        _check_int("prompt_logprobs_next", self.prompt_logprobs_next, 0, allow_none=True)
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, getattr(self, name), "a bool")
        if self.prompt_logprobs_next is not None and self.prompt_logprobs is None:
            raise _bad("prompt_logprobs_next", self.prompt_logprobs_next,
                       "None unless prompt_logprobs is set")  # fmt: skip
        ids = self.stop_token_ids
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
            raise _bad("stop_token_ids", ids, "a sequence of non-negative ints")
        ids = tuple(ids)
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise _bad("stop_token_ids", ids, "a sequence of non-negative ints")
        object.__setattr__(self, "stop_token_ids", tuple(ids))  # normalise list -> tuple
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
            raise _bad("stop", self.stop, "a list of non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        return _from_kwargs(cls, d)
