"""Preparing one HF ``generate`` call for the paged engine, with HF's own machinery.

In stock ``generate``'s order (``_prepare_generation_config`` -> ``_prepare_model_inputs`` ->
``_prepare_special_tokens`` -> attention mask -> ``_expand_inputs_for_generation`` ->
``_prepare_generated_length`` -> ``_get_logits_processor`` / ``_get_stopping_criteria``), so
defaults, validation errors and the processors are stock's by construction. Each row's prompt is
its attended tokens. Anything the engine cannot reproduce raises ``PagedFallback`` here, before
the engine is touched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from transformers.generation import GenerationMode, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
)

_STOCK_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria)

# model kwargs a paged call can take: everything else (position_ids, token_type_ids, pixel
# values ...) changes what the model computes, so the call runs stock
_MODEL_KWARGS = frozenset({"attention_mask", "use_cache", "logits_to_keep"})


class PagedFallback(Exception):
    """This call must run stock ``generate``. ``reason`` is a short key (one warning per key per
    process); ``detail`` says why in words."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass
class PreparedCall:
    """One generate call, prepared as stock prepares it (rows already repeated for
    ``num_return_sequences``)."""

    input_ids: torch.Tensor  # [B, L] as given, padding included
    prompts: list[list[int]]  # per row: the attended tokens (the engine's prompt)
    generation_config: object  # prepared GenerationConfig (final max_length, special tensors)
    processors: LogitsProcessorList  # HF-built, user processors merged in
    criteria: StoppingCriteriaList  # HF-built, user criteria merged in
    streamer: object | None
    user_processors: bool  # the caller passed logits processors: they see every row's logits
    user_criteria: bool  # the caller passed stopping criteria
    left_padded: bool  # every row is [pads..., tokens...]
    assisted: bool = False  # assisted decoding (prompt lookup or an assistant model)
    assistant_model: object | None = None

    @property
    def wants_scores(self) -> bool:
        gen = self.generation_config
        return bool(gen.return_dict_in_generate and (gen.output_scores or gen.output_logits))

    @property
    def observed(self) -> bool:
        """The caller sees every step (so the engine must not sample on its own)."""
        return (
            self.user_processors
            or self.user_criteria
            or self.streamer is not None
            or self.wants_scores
        )

    @property
    def max_new_tokens(self) -> int:
        """Steps stock's loop runs at most (at least one; a user MaxLengthCriteria wins)."""
        max_length = self.criteria.max_length
        if max_length is None:
            max_length = self.generation_config.max_length
        return max(1, max_length - self.input_ids.shape[1])

    @property
    def pad_token_id(self) -> int | None:
        pad = self.generation_config._pad_token_tensor
        return None if pad is None else int(pad)


def prepare_call(
    model,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    streamer=None,
    assistant_model=None,
    **kwargs,
) -> PreparedCall:
    """Stock ``generate``'s steps 1-8 for a decoder-only call, without running the model.

    Raises:
        PagedFallback: the call needs something only stock ``generate`` does.
        ValueError / TypeError: whatever stock raises for the same arguments.
    """
    kwargs = dict(kwargs)
    tokenizer = kwargs.pop("tokenizer", None)
    defaults = {  # has_default_max_length / has_default_min_length, as stock computes them
        name: kwargs.get(name) is None
        and (generation_config is None or getattr(generation_config, name) is None)
        and getattr(model.generation_config, name) is None
        for name in ("max_length", "min_length")
    }
    gen, model_kwargs = model._prepare_generation_config(generation_config, **kwargs)
    mode = gen.get_generation_mode(assistant_model)
    _check_generation_config(gen, mode)
    model._validate_model_kwargs(model_kwargs.copy())
    mode_kwargs = {k: v for k, v in (("tokenizer", tokenizer), ("streamer", streamer),
                                     ("assistant_model", assistant_model)) if v is not None}  # fmt: skip
    model._validate_generation_mode(mode, gen, mode_kwargs)
    inputs_tensor, mask = _prepare_prompt(model, gen, inputs, model_kwargs)

    input_ids, expanded = model._expand_inputs_for_generation(
        input_ids=inputs_tensor,
        expand_size=gen.num_return_sequences,
        is_encoder_decoder=False,
        attention_mask=mask,
    )
    mask, length = expanded["attention_mask"], input_ids.shape[1]  # [B, L]
    gen = model._prepare_generated_length(
        generation_config=gen,
        has_default_max_length=defaults["max_length"],
        has_default_min_length=defaults["min_length"],
        model_input_name="input_ids",
        inputs_tensor=inputs_tensor,
        input_ids_length=length,
    )
    model._validate_generated_length(gen, length, defaults["max_length"])
    all_ones = bool((mask == 1).all())  # stock drops an all-ones mask before building processors
    processors = model._get_logits_processor(
        generation_config=gen,
        input_ids_seq_length=length,
        encoder_input_ids=inputs_tensor,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        logits_processor=LogitsProcessorList() if logits_processor is None else logits_processor,
        device=inputs_tensor.device,
        model_kwargs={"attention_mask": None if all_ones else mask},
    )
    criteria = model._get_stopping_criteria(
        generation_config=gen,
        stopping_criteria=StoppingCriteriaList()
        if stopping_criteria is None
        else stopping_criteria,
        tokenizer=tokenizer,
    )
    keep = mask.bool()
    return PreparedCall(
        input_ids=input_ids,
        prompts=[row[k].tolist() for row, k in zip(input_ids, keep, strict=True)],
        generation_config=gen,
        processors=processors,
        criteria=criteria,
        streamer=streamer,
        user_processors=bool(logits_processor),
        # transformers' own max-length / EOS / stop-string criteria are planned natively
        user_criteria=any(type(c) not in _STOCK_CRITERIA for c in stopping_criteria or ()),
        left_padded=bool((keep[:, 1:] >= keep[:, :-1]).all()),
        assisted=mode == GenerationMode.ASSISTED_GENERATION,
        assistant_model=assistant_model,
    )


def _prepare_prompt(model, gen, inputs, model_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids [B, L], attention_mask [B, L])`` as stock builds them (a missing mask is
    inferred from the pad id); sets the config's special-token tensors."""
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(
        inputs, gen.bos_token_id, model_kwargs
    )
    if input_name != "input_ids" or inputs_tensor.dim() != 2:
        raise PagedFallback("inputs_embeds", "the prompt is not a 2-D input_ids tensor")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if extra:
        raise PagedFallback("model_kwargs", f"model inputs {extra} are passed to the forward")
    mask = model_kwargs.get("attention_mask")
    model._prepare_special_tokens(
        gen, mask is not None, device=inputs_tensor.device, batch_size=inputs_tensor.shape[0]
    )
    if mask is None:
        mask = model._prepare_attention_mask_for_generation(inputs_tensor, gen, model_kwargs)
    elif mask.dim() > 2:
        raise ValueError("`attention_mask` passed to `generate` must be 2D.")
    if mask.shape != inputs_tensor.shape:
        raise PagedFallback("attention_mask", "attention_mask's shape differs from input_ids'")
    if inputs_tensor.shape[1] == 0 or bool((mask.sum(dim=-1) == 0).any()):
        raise PagedFallback("empty_prompt", "a row has no attended token")
    if bool((mask[:, -1] == 0).any()):
        # stock gives a right-padded row a pad query and restarts its positions after the pads:
        # no paged engine can reproduce that, so those calls run stock
        raise PagedFallback("right_padding", "the input is right padded")
    return inputs_tensor, mask


def _check_generation_config(gen, mode) -> None:
    served = (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE)
    if mode not in served + (GenerationMode.ASSISTED_GENERATION,):
        raise PagedFallback(mode.value, f"the generation mode is {mode.value}")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(gen, flag, False):
            raise PagedFallback(flag, f"{flag}=True needs the model's own forward")
    if gen.guidance_scale is not None and gen.guidance_scale != 1:
        raise PagedFallback("guidance_scale", "classifier-free guidance runs a second model pass")
    if getattr(gen, "token_healing", False):
        raise PagedFallback("token_healing", "token_healing rewrites the prompt")


def check_fits(call: PreparedCall, engine, native: bool) -> None:
    """PagedFallback when the engine would cut a row short or (external path) could not hold
    the whole batch's KV at once."""
    max_new = call.max_new_tokens
    prompt = max(len(p) for p in call.prompts)
    limit = engine.runtime.max_model_len
    if prompt + max_new > limit:
        fix = (
            f"pass max_new_tokens <= {limit - prompt}"
            if prompt < limit
            else f"shorten the prompt below {limit} tokens"
        )
        raise PagedFallback(
            "max_model_len",
            f"a row may reach {prompt + max_new} tokens (longest prompt {prompt} + "
            f"max_new_tokens={max_new}), over the engine's max_model_len={limit}: {fix}, "
            "or build the engine with a larger max_model_len",
        )
    if native:
        return
    block = engine.config.kv_block_size
    need = sum(math.ceil((len(p) + max_new) / block) for p in call.prompts)
    if need > engine.runtime.num_kv_blocks:
        # every row of a step must be paused at once holding its KV; more would thrash
        raise PagedFallback(
            "kv_cache",
            f"the batch needs up to {need} KV blocks at once, the engine has "
            f"{engine.runtime.num_kv_blocks}",
        )
