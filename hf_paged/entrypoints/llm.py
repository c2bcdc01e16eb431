"""``LLM``: the offline batch API (vLLM's shape) over one LLMEngine."""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq

import numpy as np
import torch
from tqdm.auto import tqdm

from hf_paged.config import EngineConfig, SamplingParams
from hf_paged.engine.core.outputs import RequestOutput
from hf_paged.engine.core.request import EngineRequest, budget, resolve_max_tokens
from hf_paged.engine.llm_engine import LLMEngine
from hf_paged.entrypoints.lora_request import LoraResolver
from hf_paged.entrypoints.multimodal_prompt import is_multimodal_prompt
from hf_paged.integration.engine_owner import EngineOwner


class LLM:
    """Generate for many prompts at once with continuous batching.

    Args:
        model: checkpoint directory or a loaded HF causal-LM.
        tokenizer: optional; defaults to the one saved beside the checkpoint.
        processor: a vision-language model's processor, for multimodal prompts
            (``{"prompt": ..., "multi_modal_data": {"image": ...}}``); defaults to the one
            saved beside the checkpoint (``model.name_or_path`` for a loaded model).
        **engine_kwargs: EngineConfig keys (``max_num_seqs``, ``num_kv_blocks``, ...).

    An in-memory model's weights are followed: values changed in place later (any optimizer
    step, ``load_state_dict``, ``copy_``) are copied into the engine's own tensors by the next
    ``generate``; a replaced parameter or a switched PEFT adapter rebuilds the engine first
    (``models/weight_watch.py``); plain LoRA adapters are served from slots and read at every
    call. Calls from several threads run one after another.

    LoRA (``docs/adapters.md``): with ``enable_lora=True``, ``generate(..., lora_request=...)``
    runs prompts under adapters saved by PEFT (``LoRARequest``, vLLM's shape). An in-memory
    PEFT model runs its active adapters by default.

    Example:
        >>> with LLM("path/to/ckpt", max_num_seqs=64) as llm:
        ...     outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0))
        ...     print(outs[0].text)
    """

    def __init__(self, model, tokenizer=None, processor=None, **engine_kwargs):
        config = EngineConfig.from_dict(engine_kwargs)  # bad keys fail before anything loads
        self._closed = False
        self._processor = processor
        self._vision = None  # (stock model, processor) for multimodal prompts, once needed
        self._model_path = None if isinstance(model, torch.nn.Module) else model
        self._model = None  # a weak reference to an in-memory model
        self._loras = LoraResolver()
        if isinstance(model, torch.nn.Module):
            # an in-memory model: its weight changes are followed (fused copies would be
            # stale); once the caller drops the model, the engine keeps what it was built with
            ref = weakref.ref(model)
            self._owner = EngineOwner(lambda cfg: LLMEngine(ref(), cfg, tokenizer=tokenizer), ref)
            self._model = ref
            self._owner.configure(config)
            self._owner.get()  # built now: errors surface here, not at the first generate
        else:
            self._owner = EngineOwner(engine=LLMEngine(model, config, tokenizer=tokenizer))

    @property
    def engine(self) -> LLMEngine:
        """The engine. Raises RuntimeError once ``close`` ran."""
        self._check_open()
        return self._owner.engine

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this LLM is closed (close() or its with-block ended) and is not allowed to run "
                "again: build a new LLM"
            )

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        """The tokenizer (None without one), as vLLM's ``LLM.get_tokenizer``."""
        return self.tokenizer

    def _encode(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            prompt = _unwrap_prompt_dict(prompt)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "prompts=<str> is not allowed without a tokenizer: save one beside the "
                    "checkpoint, pass tokenizer=..., or give token-id lists"
                )
            return prompt, self.engine.validate_prompt(self.tokenizer.encode(prompt))
        return None, self.engine.validate_prompt(prompt)

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        proposer=None,
        lora_request=None,
    ) -> list[RequestOutput]:
        """One RequestOutput per prompt, in input order.

        Args:
            prompts: a string, a list (or 1-D tensor) of token ids, vLLM's ``{"prompt": text}``
                or ``{"prompt_token_ids": ids}``, or a list of any of these; a 2-D tensor is a
                batch of equal-length prompts.
            sampling_params: one SamplingParams for all prompts or one per prompt.
            use_tqdm: show a progress bar over generated tokens (of the most requested).
            proposer: speculative decoding for every prompt (``hf_paged.engine.spec.proposers``:
                ``NgramProposer`` or ``DraftModelProposer``); the outputs are what they are
                without it (greedy: the same tokens; sampling: the same distribution).
            lora_request: a ``LoRARequest`` for every prompt, or a list with one per prompt
                (None: the base model); None = the base model, or an in-memory PEFT model's
                active adapters. Needs ``enable_lora=True`` (a PEFT model has slots already).

        Raises:
            ValueError: a bad prompt or a params list of the wrong length. Nothing is queued
                then, and the engine stays usable.
            RuntimeError: the LLM is closed.
        """
        self._check_open()
        with self._owner.hold() as held:
            held.get()  # rebuilt first when an in-memory model's weights changed
            return self._generate(prompts, sampling_params, use_tqdm, proposer,
                                  lora_request=lora_request)  # fmt: skip

    def stream(
        self,
        prompts,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        proposer=None,
        lora_request=None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """``generate``'s requests, yielding ``(input index, RequestOutput)`` as each finishes
        (what ``hf-paged generate`` writes line by line). Every prompt is checked before the
        first is queued; closing the iterator early (``break``, Ctrl-C) aborts what is still
        running and leaves the engine usable.

        Raises:
            ValueError / TypeError: as ``generate``, at the first ``next``.
            RuntimeError: the LLM is closed.
        """
        self._check_open()
        with self._owner.hold() as held:
            held.get()
            requests = self._requests(prompts, sampling_params, proposer,
                                      lora_request=lora_request)  # fmt: skip
            with self.engine.stream(requests) as outputs:
                yield from outputs

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate for one conversation (a list of ``{"role", "content"}`` dicts) or a list of
        them, rendered with the tokenizer's chat template (vLLM's ``LLM.chat``). The rendered
        text is ``RequestOutput.prompt``; its ids are the template's, no special tokens added.

        Raises:
            ValueError: no tokenizer, or it has no chat template and none was given.
        """
        self._check_open()
        tok = self.tokenizer
        if tok is None or (chat_template is None and not getattr(tok, "chat_template", None)):
            raise ValueError(
                "LLM.chat is not allowed without a tokenizer that has a chat template: save one "
                "beside the checkpoint, pass tokenizer=..., or give chat_template=..."
            )
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [
            tok.apply_chat_template(
                conv,
                tokenize=False,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                **(chat_template_kwargs or {}),
            )
            for conv in convs
        ]
        with self._owner.hold() as held:
            held.get()
            ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
            encoded = [(t, self.engine.validate_prompt(i)) for t, i in zip(texts, ids)]
            return self._generate(texts, sampling_params, use_tqdm, encoded=encoded)

    def _generate(self, prompts, sampling_params, use_tqdm: bool, proposer=None, encoded=None,
                  lora_request=None):  # fmt: skip
        requests = self._requests(prompts, sampling_params, proposer, encoded, lora_request)
        total = sum(budget(r.params) for r in requests)
        bar = tqdm(total=total, desc="hf_paged", unit="tok", disable=not use_tqdm)
        try:
            return self.engine.run(requests, progress=bar.update)
        finally:
            bar.n = min(bar.n, total)
            bar.close()

    def _requests(self, prompts, sampling_params, proposer=None, encoded=None, lora_request=None):
        """One checked EngineRequest per prompt, with its adapter (nothing queued yet)."""
        prompts = _as_prompt_list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, dict):  # list() of it would give its keys
            raise TypeError(
                f"sampling_params=<dict with keys {sorted(map(str, sampling_params))}> is not "
                "allowed: must be a SamplingParams or a list of them, e.g. "
                "SamplingParams(**params)"
            )
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(
                    f"sampling_params has {len(params)} entries but there are {len(prompts)} "
                    "prompts: give one SamplingParams or one per prompt"
                )
        for i, sp in enumerate(params):
            if not isinstance(sp, SamplingParams):
                raise TypeError(
                    f"sampling_params[{i}]={sp!r} is not allowed: must be a SamplingParams"
                )
        # validate everything before queueing
        max_len = self.engine.runtime.max_model_len
        requests = []
        for p, enc, sp in zip(prompts, encoded or [None] * len(prompts), params):
            if enc is None and is_multimodal_prompt(p):
                fields = self._multimodal_fields(p)
                sp = resolve_max_tokens(sp, len(fields["prompt_token_ids"]), max_len)
                requests.append(EngineRequest(params=sp, prompt=p["prompt"], proposer=proposer,
                                              **fields))  # fmt: skip
                continue
            text, ids = enc or self._encode(p)
            requests.append(EngineRequest(ids, resolve_max_tokens(sp, len(ids), max_len), text,
                                          proposer=proposer))  # fmt: skip
        for r, key in zip(requests, self._lora_keys(lora_request, len(requests)), strict=True):
            r.lora_key = key
        return requests

    def _lora_keys(self, lora_request, num_prompts: int) -> list[str | None]:
        """Per prompt, the engine key of its adapter (``lora_request.py``); an in-memory PEFT
        model served from slots runs its active adapters when none is given."""
        model = self._model() if self._model is not None else None
        lora = self.engine.lora
        if lora_request is None and model is not None and lora is not None and lora.spec.from_peft:
            from hf_paged.models.adapters.peft_lora import row_adapters

            adapter = row_adapters(model, 1)[0]
            return [None if adapter is None else self.engine.add_lora(adapter)] * num_prompts
        return self._loras.keys_for(self.engine, lora_request, num_prompts)

    def _multimodal_fields(self, prompt: dict) -> dict:
        """A multimodal prompt's request fields (``multimodal_prompt.py``). Raises ValueError
        for a model that is not a vision-language model, and for a bad prompt."""
        from hf_paged.entrypoints.multimodal_prompt import (
            check_multimodal_prompt,
            load_vision_side,
            multimodal_request_fields,
        )
        from hf_paged.models.generic.support import image_text_class

        if image_text_class(self.engine.hf_config) is None:
            raise ValueError(
                f"prompts=<dict with keys {sorted(map(str, prompt))}> is not allowed: "
                "multi_modal_data needs a vision-language model (AutoModelForImageTextToText), "
                f"and {type(self.engine.hf_config).__name__} is not one"
            )
        text, images = check_multimodal_prompt(prompt)
        if self._vision is None:
            model = self._model() if self._model is not None else None
            if model is None:
                model, processor = load_vision_side(self._model_path)
            else:
                processor = self._processor
                if processor is None:
                    from transformers import AutoProcessor

                    processor = AutoProcessor.from_pretrained(model.name_or_path)
            self._vision = (model, self._processor or processor)
        model, processor = self._vision
        return multimodal_request_fields(model, processor, self.engine, text, images)

    @property
    def stats(self) -> dict:
        return self.engine.stats

    def update_weights(self, weights) -> int:
        """Give the engine new values for some of the model's weights, ``(HF checkpoint name,
        full tensor)`` pairs (a policy's ``named_parameters()`` or ``state_dict().items()``), as
        an RL loop syncs its trained policy into the generator (vLLM's ``load_weights``). Every
        rank of a tensor-parallel engine copies its part in place; the KV cache stays, the
        prefix cache and the encoder cache (image features) are dropped. Returns how many tensors rank 0 copied.

        Raises:
            ValueError: an LLM built on an in-memory model (its engine follows that model's own
                weights: change them instead), a name the model lacks, or a shape that does
                not fit.
            RuntimeError: the LLM is closed.
        """
        self._check_open()
        if self._owner.follows_a_model:
            raise ValueError(
                "update_weights is not allowed on an LLM built on an in-memory model: the engine "
                "follows that model's weights, so change them instead (an optimizer step, "
                "load_state_dict) and the next generate serves them"
            )
        with self._owner.hold() as held:
            return held.get().update_weights(weights)

    def reset_prefix_cache(self) -> int:
        """Drop the prefix cache's blocks that no running request holds (as vLLM's
        ``LLM.reset_prefix_cache``), e.g. between timed runs; the number of blocks dropped."""
        return self.engine.block_manager.reset_prefix_cache()

    def close(self) -> None:
        """Free the engine (KV cache, CUDA graphs, weights); the LLM can't run after it (a
        ``generate`` running in another thread ends first). Idempotent."""
        self._closed = True
        self._owner.close_when_free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _as_prompt_list(prompts) -> list:
    """A list of prompts: one string or one id sequence (list, 1-D tensor or numpy array)
    becomes a list of one; a 2-D tensor or array is one prompt per row, as is a numpy array of
    arrays (what a ragged column gives)."""
    if isinstance(prompts, np.ndarray) and prompts.dtype == object:
        return list(prompts)
    if isinstance(prompts, (torch.Tensor, np.ndarray)):
        if prompts.ndim == 1:
            return [prompts.tolist()]
        if prompts.ndim == 2:
            return prompts.tolist()
        kind = "tensor" if isinstance(prompts, torch.Tensor) else "array"
        raise ValueError(
            f"prompts=<{kind} of shape {tuple(prompts.shape)}> is not allowed: "
            "give a 1-D tensor of token ids (one prompt) or a 2-D tensor (one prompt per row)"
        )
    if isinstance(prompts, str) or (
        isinstance(prompts, Seq) and prompts and isinstance(prompts[0], int)
    ):
        return [prompts]
    if isinstance(prompts, dict):
        return [prompts]
    if not isinstance(prompts, Iterable) or isinstance(prompts, bytes):
        raise TypeError(
            f"prompts={prompts!r} is not allowed: give a string, a list of token ids, or a list "
            "of either (a 2-D tensor is one prompt per row)"
        )
    return list(prompts)


_PROMPT_KEYS = ("prompt", "prompt_token_ids")


def _unwrap_prompt_dict(prompt: dict):
    """The text or ids of vLLM's ``TextPrompt`` ``{"prompt": text}`` or ``TokensPrompt``
    ``{"prompt_token_ids": ids}``; other keys (``multi_modal_data``, ...) are refused by name."""
    keys = [k for k in _PROMPT_KEYS if k in prompt]
    other = sorted(map(str, prompt.keys() - set(_PROMPT_KEYS)))
    if len(keys) != 1 or other:
        raise ValueError(
            f"prompts=<dict with keys {sorted(map(str, prompt))}> is not allowed: a dict prompt "
            'must have exactly one key, "prompt" (a string) or "prompt_token_ids" (token ids)'
        )
    value = prompt[keys[0]]
    if (keys[0] == "prompt") != isinstance(value, str):
        want = "a string" if keys[0] == "prompt" else "token ids"
        raise TypeError(f"prompts=<dict with {keys[0]}={value!r}> is not allowed: must be {want}")
    return value
