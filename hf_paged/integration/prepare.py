"""Preparing one HF ``generate`` call for the paged engine, with HF's own machinery.

In stock ``generate``'s order (``_prepare_generation_config`` -> ``_prepare_model_inputs`` ->
``_prepare_special_tokens`` -> attention mask -> ``_expand_inputs_for_generation`` ->
``_prepare_generated_length`` -> ``_get_logits_processor`` / ``_get_stopping_criteria``), so
defaults, validation errors and the processors are stock's by construction. Each row's prompt is
its attended tokens. Anything the engine cannot reproduce is a ``Refusal`` returned here, before
the engine is touched (``route`` raises it). No engine here: ``plan.py`` turns a prepared call into engine requests.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from transformers.generation import GenerationMode, LogitsProcessorList, StoppingCriteriaList
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    StopStringCriteria,
)

from hf_paged.engine.core.prompt_embeds import PromptEmbeds
from hf_paged.refusal import Refusal

_STOCK_CRITERIA = (MaxLengthCriteria, EosTokenCriteria, StopStringCriteria)
# beam search and beam sampling run in ``beam_search.py``; group and constrained beams are hub
# ``custom_generate`` code in transformers v5 and run stock
_SERVED_MODES = (
    GenerationMode.GREEDY_SEARCH,
    GenerationMode.SAMPLE,
    GenerationMode.BEAM_SEARCH,
    GenerationMode.BEAM_SAMPLE,
    GenerationMode.ASSISTED_GENERATION,
)

# model kwargs a paged call can take: everything else (position_ids, token_type_ids, pixel
# values ...) changes what the model computes, so the call runs stock
_MODEL_KWARGS = frozenset({"attention_mask", "use_cache", "logits_to_keep"})
CACHE_KWARGS = ("cache", "past_key_values", "cache_params")  # generate's names, new to old


@dataclass
class PreparedCall:
    """One generate call, prepared as stock prepares it (rows already repeated for
    ``num_return_sequences``, or ``num_beams`` for beams). Derived values are computed once,
    here."""

    input_ids: torch.Tensor  # [B, L] as given, padding included
    prompts: list[list[int]]  # per row: the attended tokens (the engine's prompt)
    generation_config: object  # prepared GenerationConfig (final max_length, special tensors)
    processors: LogitsProcessorList  # HF-built, user processors merged in
    criteria: StoppingCriteriaList  # HF-built, user criteria merged in
    streamer: object | None
    user_processors: bool  # the caller passed logits processors: they see every row's logits
    user_criteria: bool  # the caller passed stopping criteria
    left_padded: bool  # every row is [pads..., tokens...]
    wants_scores: bool  # return_dict_in_generate with output_scores or output_logits
    observed: bool  # the caller sees every step (so the engine must not sample on its own)
    max_new_tokens: int  # steps stock's loop runs at most (>= 1; a user MaxLengthCriteria wins)
    pad_token_id: int | None
    assisted: bool = False  # assisted decoding (prompt lookup or an assistant model)
    assistant_model: object | None = None
    beams: bool = False  # beam search or beam sampling (num_beams > 1; ``beam_search.py``)
    attention_mask: torch.Tensor | None = None  # [B, L] 0/1, rows repeated like input_ids
    # a vision-language model's image inputs (``integration/multimodal``), as passed, for the
    # rows of ``mm_input_ids`` [B0, L] / ``mm_attention_mask`` (before the rows were repeated)
    mm_inputs: dict | None = None
    mm_input_ids: torch.Tensor | None = None
    mm_attention_mask: torch.Tensor | None = None
    # per row of ``prompts``: its ``PromptEmbeds`` (None: from its ids), set by the route for
    # images, by ``prompt_rows`` for ``inputs_embeds``
    prompt_embeds: list | None = None
    # the prompt came as ``inputs_embeds``: ``prompts`` are the caller's ids or placeholders,
    # and ``input_ids`` what stock loops on ([B, 0] without ids)
    from_inputs_embeds: bool = False
    # per row of ``prompts``: the LoRA adapter key it runs under (None: none); set by the call
    # once its engine registered the adapters (``paged_call.generate_paged``)
    lora_keys: list | None = None
    # per row of ``prompts``: its bidirectional ranges (Gemma 3's images), set by the route
    bidirectional_ranges: list | None = None

    def request_embeds(self, i: int):
        """Row ``i``'s prompt embeddings (None for a text-only call or row)."""
        return None if self.prompt_embeds is None else self.prompt_embeds[i]

    def request_inputs(self, i: int) -> dict:
        """Row ``i``'s ``EngineRequest`` fields beyond its ids: prompt embeddings and
        bidirectional ranges."""
        ranges = None if self.bidirectional_ranges is None else self.bidirectional_ranges[i]
        return {"prompt_embeds": self.request_embeds(i), "bidirectional_ranges": ranges}


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
) -> PreparedCall | Refusal:
    """Stock ``generate``'s steps 1-8 for a decoder-only call, without running the model.

    Returns:
        The prepared call, or the ``Refusal`` of a call that needs something only stock
        ``generate`` does.

    Raises:
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
    refusal = _generation_config_refusal(gen, mode)
    if refusal is not None:
        return refusal
    model._validate_model_kwargs(model_kwargs.copy())
    mode_kwargs = {k: v for k, v in (("tokenizer", tokenizer), ("streamer", streamer),
                                     ("assistant_model", assistant_model)) if v is not None}  # fmt: skip
    model._validate_generation_mode(mode, gen, mode_kwargs)
    prompt = _prepare_prompt(model, gen, inputs, model_kwargs)
    if isinstance(prompt, Refusal):
        return prompt
    inputs_tensor, mask, mm_inputs, ids = prompt
    input_mask = mask  # [B0, L]: the rows as given, before they are repeated
    embeds = None if ids is inputs_tensor else inputs_tensor  # [B, L, hidden] inputs_embeds
    extra = {"attention_mask": mask} if embeds is None else {"attention_mask": mask,
                                                            "inputs_embeds": embeds}  # fmt: skip
    input_ids, expanded = model._expand_inputs_for_generation(
        input_ids=ids,
        expand_size=max(gen.num_beams, gen.num_return_sequences),  # as stock: rows per prompt
        is_encoder_decoder=False,
        **extra,
    )
    mask, length = expanded["attention_mask"], input_ids.shape[1]  # [B, L]; L = 0: embeds only
    gen = model._prepare_generated_length(
        generation_config=gen,
        has_default_max_length=defaults["max_length"],
        has_default_min_length=defaults["min_length"],
        model_input_name="input_ids" if embeds is None else "inputs_embeds",
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
    prompts, rows = _prompt_rows(input_ids, keep, expanded.get("inputs_embeds"))
    # transformers' own max-length / EOS / stop-string criteria are planned natively
    user_criteria = any(type(c) not in _STOCK_CRITERIA for c in stopping_criteria or ())
    wants_scores = bool(gen.return_dict_in_generate and (gen.output_scores or gen.output_logits))
    max_length = criteria.max_length if criteria.max_length is not None else gen.max_length
    pad = gen._pad_token_tensor
    return PreparedCall(
        input_ids=input_ids,
        prompts=prompts,
        generation_config=gen,
        processors=processors,
        criteria=criteria,
        streamer=streamer,
        user_processors=bool(logits_processor),
        user_criteria=user_criteria,
        left_padded=bool((keep[:, 1:] >= keep[:, :-1]).all()),
        wants_scores=wants_scores,
        observed=bool(logits_processor) or user_criteria or streamer is not None or wants_scores,
        max_new_tokens=max(1, math.ceil(max_length - length)),  # a float max_new_tokens counts up
        pad_token_id=None if pad is None else int(pad),
        assisted=mode == GenerationMode.ASSISTED_GENERATION,
        assistant_model=assistant_model,
        beams=mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE),
        attention_mask=mask,
        mm_inputs=mm_inputs,
        mm_input_ids=inputs_tensor if mm_inputs else None,
        mm_attention_mask=input_mask if mm_inputs else None,
        prompt_embeds=rows,
        from_inputs_embeds=embeds is not None,
    )


def _prepare_prompt(model, gen, inputs, model_kwargs):
    """``(inputs_tensor, attention_mask [B, L], image inputs or None, input_ids)`` as stock
    builds them (a missing mask is inferred from the pad id), or the prompt's ``Refusal``; sets
    the config's special-token tensors. ``inputs_tensor`` is the ``[B, L]`` input_ids (then
    ``input_ids`` is it), or ``[B, L, hidden]`` inputs_embeds with the ``[B, 0]`` or ``[B, L]``
    ids stock loops on."""
    inputs_tensor, input_name, model_kwargs = model._prepare_model_inputs(
        inputs, gen.bos_token_id, model_kwargs
    )
    ids = inputs_tensor
    if input_name == "inputs_embeds" and inputs_tensor.dim() == 3:
        ids = model_kwargs.pop("input_ids")
        model_kwargs.pop("inputs_embeds", None)  # stock keeps it there for its first step
        if ids.shape[1] not in (0, inputs_tensor.shape[1]):
            return Refusal("inputs_embeds", "input_ids and inputs_embeds differ in length")
    elif input_name != "input_ids" or inputs_tensor.dim() != 2:
        return Refusal("inputs_embeds", "the prompt is neither input_ids nor inputs_embeds")
    extra = sorted(k for k, v in model_kwargs.items() if v is not None and k not in _MODEL_KWARGS)
    if any(k in CACHE_KWARGS for k in extra):  # ``generate_paged`` takes it out and serves it
        return Refusal("past_key_values", "a cache was passed to a many-prompt front end")
    mm_inputs = _multimodal_inputs(model, model_kwargs, extra)
    if isinstance(mm_inputs, Refusal):
        return mm_inputs
    extra = [k for k in extra if k not in (mm_inputs or ())]
    if extra:
        return Refusal("model_kwargs", f"model inputs {extra} are passed to the forward")
    mask = model_kwargs.get("attention_mask")
    model._prepare_special_tokens(
        gen, mask is not None, device=inputs_tensor.device, batch_size=inputs_tensor.shape[0]
    )
    if mask is None:
        mask = model._prepare_attention_mask_for_generation(inputs_tensor, gen, model_kwargs)
    elif mask.dim() > 2:
        raise ValueError("`attention_mask` passed to `generate` must be 2D.")
    if mask.shape != inputs_tensor.shape[:2]:
        return Refusal("attention_mask", "attention_mask's shape differs from the input's")
    if not bool(((mask == 0) | (mask == 1)).all()):
        # stock's forward takes its positions from the mask's running sum and its attention
        # bias from the values: the engine knows attended (1) and padding (0) only
        return Refusal("attention_mask", "attention_mask holds values other than 0 and 1")
    if inputs_tensor.shape[1] == 0 or bool((mask.sum(dim=-1) == 0).any()):
        return Refusal("empty_prompt", "a row has no attended token")
    if bool((mask[:, -1] == 0).any()):
        # stock gives a right-padded row a pad query and restarts its positions after the pads:
        # no paged engine can reproduce that, so those calls run stock
        return Refusal("right_padding", "the input is right padded")
    if mm_inputs and ids is not inputs_tensor:
        return Refusal("inputs_embeds", "inputs_embeds with image inputs")
    return inputs_tensor, mask, mm_inputs, ids


def _multimodal_inputs(model, model_kwargs: dict, extra: list[str]) -> dict | Refusal | None:
    """A vision-language model's image inputs among the call's model kwargs (None: not such a
    model, or no such input). Video inputs run stock (their ``Refusal``)."""
    from hf_paged.integration import multimodal

    if not extra or not multimodal.is_multimodal(model):
        return None
    keys = multimodal.multimodal_keys(model)
    found = {k: model_kwargs[k] for k in extra if k in keys}
    video = sorted(k for k in found if k in multimodal.VIDEO_KEYS)
    if video:
        return Refusal("video_inputs", f"video inputs {video} are not served paged yet")
    return found or None


_calls = itertools.count()  # numbers the inputs_embeds calls: each row's prefix-cache key
_PLACEHOLDER = 0  # an id every vocabulary has; never embedded (its row replaces it)


def _prompt_rows(input_ids, keep, embeds) -> tuple[list[list[int]], list | None]:
    """Each row's engine prompt, and its ``PromptEmbeds`` with ``inputs_embeds``.

    ``input_ids`` ``[B, L]`` (``[B, 0]`` with embeddings alone), ``keep`` ``[B, L]`` its attended
    positions, ``embeds`` ``[B, L, hidden]`` or None. Stock prefills the embeddings and decodes
    from ids; the engine does the same with each row's attended rows as its prompt's
    embeddings. The ids under them are the caller's ``input_ids`` when passed with the
    embeddings, else placeholders no processor sees (stock's loop holds ``[B, 0]`` ids). Each
    row's key is its own (the call's number, the row): the returned cache's second pass over the
    same rows finds their KV in the prefix cache, and no other call shares it.
    """
    if embeds is None:
        return [row[k].tolist() for row, k in zip(input_ids, keep, strict=True)], None
    with_ids = input_ids.shape[1] == embeds.shape[1]
    call = next(_calls)
    prompts, rows = [], []
    for i, k in enumerate(keep):
        prompts.append(input_ids[i][k].tolist() if with_ids else [_PLACEHOLDER] * int(k.sum()))
        rows.append(PromptEmbeds.dense(embeds[i][k], key=("inputs_embeds", call, i)))
    return prompts, rows


def _generation_config_refusal(gen, mode) -> Refusal | None:
    """Why the prepared generation config runs stock, or None."""
    if mode not in _SERVED_MODES:
        return Refusal(mode.value, f"the generation mode is {mode.value}")
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(gen, flag, False):
            return Refusal(flag, f"{flag}=True needs the model's own forward")
    if gen.guidance_scale is not None and gen.guidance_scale != 1:
        return Refusal("guidance_scale", "classifier-free guidance runs a second model pass")
    if getattr(gen, "token_healing", False):
        return Refusal("token_healing", "token_healing rewrites the prompt")
    return None
