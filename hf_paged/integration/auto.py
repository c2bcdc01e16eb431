"""``AutoPagedModelForCausalLM``: a checkpoint served by the paged engine, shaped like an HF model.

``AutoPagedModelForCausalLM.from_pretrained(path, **engine_kwargs)`` returns a
``PagedModelForCausalLM``: it has what callers of ``generate`` read (``config``,
``generation_config``, ``device``, ``dtype``, ``can_generate()``, ``name_or_path``) and a
``generate`` with stock semantics, so ``pipeline("text-generation", model=that, tokenizer=tok)``
and evaluation harnesses work unchanged. The full HF model is never loaded: the engine loads the
weights itself (with ``tensor_parallel_size > 1`` each worker loads only its shard), and the
HF-side preparation of a call (defaults, validation, logits processors, stopping criteria) runs on
a skeleton of the HF model built on the ``meta`` device, which holds no weights.

``generate`` runs the same code as ``model.generate(..., backend="paged")``
(``paged_call.generate_paged``), prompt lookup and an ``assistant_model`` (an HF model or another
``PagedModelForCausalLM``) included. What that code cannot reproduce (beam search, a passed-in
cache ...) raises ``NotImplementedError``: there is no stock model to fall back on. There is no
forward pass either: calling the object raises.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch

from hf_paged.config import EngineConfig
from hf_paged.integration import paged_call, servable
from hf_paged.integration.engine_owner import EngineOwner
from hf_paged.integration.fallback import PagedFallback
from hf_paged.paths import is_checkpoint_dir, not_a_checkpoint
from hf_paged.refusal import Refusal


class AutoPagedModelForCausalLM:
    """Factory, like transformers' ``AutoModelForCausalLM``; use ``from_pretrained``."""

    def __init__(self, *args, **kwargs):
        raise OSError(
            "AutoPagedModelForCausalLM is a factory: use "
            "AutoPagedModelForCausalLM.from_pretrained(path, **engine_kwargs)"
        )

    @classmethod
    def from_pretrained(
        cls, pretrained_model_name_or_path: str | os.PathLike, *, tokenizer=None, **engine_kwargs
    ) -> PagedModelForCausalLM:
        """Build the paged engine for a local checkpoint directory.

        Args:
            pretrained_model_name_or_path: a local checkpoint directory (config.json +
                safetensors); nothing is downloaded.
            tokenizer: overrides the tokenizer saved beside the checkpoint as ``.tokenizer``
                (``generate`` itself takes token ids, as stock's does).
            **engine_kwargs: ``EngineConfig`` keys (``max_num_seqs``, ``num_kv_blocks``,
                ``tensor_parallel_size``, ``device``, ``dtype`` ...). ``dtype`` may also be a
                ``torch.dtype``.

        Raises:
            TypeError: an unknown engine key (the message lists the allowed ones).
            ValueError: a bad engine value, a path that is not a local checkpoint directory, an
                architecture the engine does not implement, or a quantized checkpoint other
                than the FP8 formats it serves (the message names its quant_method).
        """
        path = os.fspath(pretrained_model_name_or_path)
        from hf_paged.models.peft import is_adapter_dir

        if is_adapter_dir(path):
            raise ValueError(
                f"pretrained_model_name_or_path={path!r} is not allowed: it is a PEFT adapter "
                "directory; load it with transformers (AutoModelForCausalLM.from_pretrained or "
                "PeftModel.from_pretrained) and call generate(..., backend='paged') or LLM(model)"
            )
        if not is_checkpoint_dir(path):
            raise ValueError(not_a_checkpoint("pretrained_model_name_or_path", path))
        if isinstance(engine_kwargs.get("dtype"), torch.dtype):
            engine_kwargs["dtype"] = str(engine_kwargs["dtype"]).removeprefix("torch.")
        config = EngineConfig.from_dict(engine_kwargs)  # bad keys fail before anything loads
        from hf_paged.engine.llm_engine import LLMEngine

        engine = LLMEngine(path, config, tokenizer=tokenizer)
        try:
            return cls.from_engine(engine)
        except BaseException:
            engine.close()
            raise

    @classmethod
    def from_engine(cls, engine) -> PagedModelForCausalLM:
        """An HF-shaped front end on an engine built from a checkpoint directory (e.g.
        ``LLM(path).engine``): both share the engine and its KV cache. Closing either closes it.

        Raises:
            ValueError: the engine serves an in-memory model (use its ``generate(backend="paged")``).
        """
        path = engine.runtime.model_path
        if path is None:
            raise ValueError(
                "engine=<in-memory model> is not allowed: from_engine needs an engine built from "
                "a checkpoint directory; call model.generate(..., backend='paged') instead"
            )
        _quiet_pipeline_model_check()
        return PagedModelForCausalLM(engine, _meta_skeleton(path, engine.hf_config), path)


def _meta_skeleton(path: str, hf_config):
    """The HF model class on the meta device (no weights), with the checkpoint's generation
    config: stock ``generate``'s preparation steps run on it."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    try:
        skeleton.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:  # no generation_config.json: from_config's default, as from_pretrained does
        pass
    skeleton.config._name_or_path = path
    return skeleton.eval()


class _DropPagedModelTypeError(logging.Filter):
    """The text-generation pipeline logs an error for any model class outside HF's causal-LM
    mapping; PagedModelForCausalLM is a causal LM, so that line would only mislead."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "'PagedModelForCausalLM' is not supported" not in str(record.msg)


def _quiet_pipeline_model_check() -> None:
    """Attach the filter once; it drops only that message about this class."""
    logger = logging.getLogger("transformers.pipelines.base")
    if not any(isinstance(f, _DropPagedModelTypeError) for f in logger.filters):
        logger.addFilter(_DropPagedModelTypeError())


class PagedModelForCausalLM:
    """A causal LM whose weights live in a paged engine; made by
    ``AutoPagedModelForCausalLM.from_pretrained``.

    Safe: ``generate`` (stock semantics, one call at a time per object), the attributes pipelines
    and harnesses read, ``eval()`` / ``to()`` / ``requires_grad_()`` (no-ops: the engine's
    device and dtype are fixed when it is built), ``close()``.
    Raises: calling the object (there is no forward pass), ``train(True)``.
    """

    main_input_name = "input_ids"
    input_modalities = ("text",)
    output_modalities = ("text",)
    hf_device_map = None

    def __init__(self, engine, skeleton, name_or_path: str):
        self.engine = engine
        self._skeleton = skeleton  # meta-device HF model: config, generation_config, HF helpers
        self.name_or_path = name_or_path
        self._owner = EngineOwner(engine=engine)  # one caller at a time

    # ---- what HF callers read ---------------------------------------------------------------

    @property
    def config(self):
        return self._skeleton.config

    @property
    def generation_config(self):
        return self._skeleton.generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._skeleton.generation_config = value

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.runtime.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.engine.runtime.dtype

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def training(self) -> bool:
        return False

    def can_generate(self) -> bool:
        return True

    def eval(self) -> PagedModelForCausalLM:
        return self

    def train(self, mode: bool = True) -> PagedModelForCausalLM:
        if mode:
            raise NotImplementedError(
                "PagedModelForCausalLM.train(True) is not allowed: the paged engine only runs "
                "inference; load the model with AutoModelForCausalLM to train it"
            )
        return self

    def to(self, *args, **kwargs) -> PagedModelForCausalLM:
        """No-op (pipelines call it): pass ``device=`` / ``dtype=`` to ``from_pretrained``."""
        return self

    def requires_grad_(self, requires_grad: bool = True) -> PagedModelForCausalLM:
        return self

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(
            "PagedModelForCausalLM has no forward pass: its weights live in the paged engine, "
            "which only generates. Use .generate(...), or load the model with "
            "AutoModelForCausalLM for logits or a loss."
        )

    forward = __call__

    def __repr__(self) -> str:
        cfg = self.engine.config
        return (
            f"PagedModelForCausalLM({self.name_or_path!r}, architecture="
            f"{type(self._skeleton).__name__}, device={self.engine.runtime.device}, "
            f"dtype={self.dtype}, tensor_parallel_size={cfg.tensor_parallel_size})"
        )

    # ---- generate ---------------------------------------------------------------------------

    def generate(
        self,
        inputs: torch.Tensor | None = None,
        generation_config=None,
        logits_processor=None,
        stopping_criteria=None,
        prefix_allowed_tokens_fn=None,
        synced_gpus: bool | None = None,
        assistant_model=None,
        streamer=None,
        negative_prompt_ids: torch.Tensor | None = None,
        negative_prompt_attention_mask: torch.Tensor | None = None,
        custom_generate=None,
        **kwargs,
    ):
        """Stock ``GenerationMixin.generate``'s arguments and return values, run on the engine.

        Also takes ``backend`` ("paged" or None) and ``paged_config`` (None or this object's
        engine config) so that calls written for the dispatcher work unchanged.

        Raises:
            NotImplementedError: the call needs something only stock ``generate`` does (the
                message says what); nothing was queued.
            ValueError / TypeError: what stock raises for the same arguments.
        """
        self._check_switches(kwargs.pop("backend", None), kwargs.pop("paged_config", None))
        kwargs.pop("trust_remote_code", None)  # only stock's custom_generate reads it
        named = {
            "synced_gpus": synced_gpus,
            "assistant_model": assistant_model,
            "negative_prompt_ids": negative_prompt_ids,
            "negative_prompt_attention_mask": negative_prompt_attention_mask,
            "custom_generate": custom_generate,
        }
        if assistant_model is self:  # its engine is the one drafting would need
            raise _unsupported(Refusal("assisted_self", "assistant_model is this model"))
        refusal = servable.generate_refusal(self._skeleton, named, kwargs, model_checks=False)
        if refusal is not None:
            raise _unsupported(refusal)
        if inputs is None and kwargs.get("input_ids") is None:
            inputs = self._bos_inputs(generation_config, kwargs)
        from hf_paged.integration.dispatch import hold_engine  # an HF model as the assistant

        try:
            with self._owner.hold():
                return paged_call.generate_paged(
                    self._skeleton,
                    lambda: self.engine,
                    hold_engine,
                    inputs=inputs,
                    assistant_model=assistant_model,
                    generation_config=generation_config,
                    logits_processor=logits_processor,
                    stopping_criteria=stopping_criteria,
                    prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
                    streamer=streamer,
                    **kwargs,
                )
        except PagedFallback as fb:
            if fb.reason == "max_model_len":  # the caller can fix it: not a missing feature
                raise ValueError(fb.detail) from None
            if fb.reason == "reentrant":
                raise RuntimeError(_HELD) from None
            raise _unsupported(fb.refusal) from None

    @property
    def skeleton(self):
        """The meta-device HF model stock ``generate``'s preparation runs on (no weights)."""
        return self._skeleton

    @contextlib.contextmanager
    def hold_engine(self):
        """The engine, held for one caller that keeps requests in it across many steps (a
        streaming pipeline): other threads' ``generate`` calls wait until the block ends.

        Raises:
            RuntimeError: this thread already holds it.
        """
        if self._owner.held_here:
            raise RuntimeError(_HELD)
        with self._owner.hold():
            yield self.engine

    def _check_switches(self, backend, paged_config) -> None:
        if backend not in (None, "paged"):
            raise ValueError(
                f"backend={backend!r} is not allowed for a PagedModelForCausalLM: it has no HF "
                "weights, so only backend='paged' (or none) works"
            )
        if paged_config is not None:
            if EngineConfig.from_dict(paged_config) != self.engine.config:
                raise ValueError(
                    f"paged_config={paged_config!r} is not allowed: this model's engine was built "
                    f"with {self.engine.config}; pass engine options to from_pretrained instead"
                )

    def _bos_inputs(self, generation_config, kwargs) -> torch.Tensor:
        """Stock's prompt when none is given: one BOS per row (rows from attention_mask)."""
        bos = kwargs.get("bos_token_id")
        if bos is None:
            bos = (generation_config or self.generation_config).bos_token_id
        if bos is None:
            raise ValueError("`bos_token_id` has to be defined when no `input_ids` are provided.")
        mask = kwargs.get("attention_mask")
        rows = mask.shape[0] if isinstance(mask, torch.Tensor) else 1
        return torch.full((rows, 1), int(bos), dtype=torch.long)

    # ---- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Free the KV cache and stop worker processes (a ``generate`` running in another
        thread ends first). Safe to call twice."""
        self._owner.close_when_free()

    def __enter__(self) -> PagedModelForCausalLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_HELD = (
    "PagedModelForCausalLM.generate was called while this thread is still iterating a pipeline "
    "over this model (its engine runs that pipeline's requests): finish or close that iteration "
    "first, or use a second model object"
)


def _unsupported(refusal: Refusal) -> NotImplementedError:
    return NotImplementedError(
        f"PagedModelForCausalLM.generate cannot run this call: {refusal.tagged()}. The paged "
        "engine does not implement it and there are no HF weights to fall back on; load the "
        "model with AutoModelForCausalLM for such calls"
    )
