"""Every option of ``GenerationConfig`` and every argument of ``generate``: served on the engine,
or run stock under a named reason. Nothing is accepted and ignored.

One table, read by ``docs/generate_options.md`` (which lists each entry) and by a test that walks
``GenerationConfig``'s attributes and ``generate``'s signature, so an option a new transformers
adds fails that test until someone decides it here. A status is ``"served"`` (the call runs
paged with stock's result), reason keys ``"a | b"`` (the ``PagedFallback`` that sends the call to
stock, ``[reason]`` in its warning), or ``"served | a"``: served, and the named cases (the why
says which) run stock.
"""

from __future__ import annotations

SERVED = "served"

# name -> (status, why): status is SERVED or the fallback's reason key(s), "a | b" for several
GENERATION_CONFIG_OPTIONS: dict[str, tuple[str, str]] = {
    # length
    "max_length": (SERVED, "stock's MaxLengthCriteria, planned natively"),
    "max_new_tokens": (SERVED, "stock's MaxLengthCriteria, planned natively"),
    "min_length": (SERVED, "stock's MinLengthLogitsProcessor: min_tokens on the engine"),
    "min_new_tokens": (SERVED, "stock's MinNewTokensLengthLogitsProcessor: min_tokens"),
    "early_stopping": (SERVED, "beam search runs stock's loop body (beam_search.py)"),
    "max_time": (SERVED, "stock's MaxTimeCriteria, checked each step of the external loop"),
    "stop_strings": (SERVED, "the engine's stop-string matcher, stock's semantics"),
    # strategy
    "do_sample": (SERVED, "the engine's sampler, or stock's warpers on its logits"),
    "num_beams": (SERVED, "beam search and beam sampling on forked beams (beam_search.py)"),
    "num_beam_groups": ("group_beam_search", "group beam search is hub custom_generate code"),
    "diversity_penalty": ("group_beam_search", "it only acts in group beam search"),
    "penalty_alpha": ("contrastive_search", "contrastive search needs every step's hidden states"),
    "dola_layers": ("dola_generation", "DoLa reads early-exit logits of inner layers"),
    "constraints": ("constrained_beam_search", "constrained beam search is hub code"),
    "force_words_ids": ("constrained_beam_search", "constrained beam search is hub code"),
    "low_memory": ("low_memory", "stock's beam search refuses it; stock raises its own error"),
    # cache and compilation
    "use_cache": (SERVED, "True: stock's cache is returned (contract/cache.py); False: none"),
    "cache_implementation": (
        "served | cache_implementation | recurrent_cache",
        "dynamic and static (and their sliding / hybrid forms) are returned as stock's class; "
        "'quantized' and 'offloaded' run stock when the cache is returned; 'paged' (transformers' "
        "own continuous batching) always runs stock; recurrent layers other than Gated DeltaNet "
        "run stock when the cache is returned",
    ),
    "cache_config": (SERVED, "builds stock's cache for cache_implementation, as stock does"),
    "max_cache_len": (SERVED, "sizes the returned StaticCache, as stock sizes it"),
    "compile_config": (
        SERVED,
        "the engine runs its own decode (CUDA graphs); stock's compiled forward is set up on "
        "the model where stock's criteria say so (get_compiled_call)",
    ),
    "disable_compile": (SERVED, "read by stock's compile criteria, as above"),
    "prefill_chunk_size": (SERVED, "the engine chunks prefill under its own token budget"),
    "continuous_batching_config": (
        SERVED,
        "read by transformers' continuous batching only (cache_implementation='paged', which "
        "runs stock); stock's generate does not read it otherwise",
    ),
    # logits processors: stock builds them; the engine implements some natively and runs the
    # rest as stock's own processors on its logits (external.py)
    "temperature": (SERVED, "native sampling parameter"),
    "top_k": (SERVED, "native sampling parameter"),
    "top_p": (SERVED, "native sampling parameter"),
    "min_p": (SERVED, "native sampling parameter"),
    "top_h": (SERVED, "stock's warper on the engine's logits"),
    "typical_p": (SERVED, "stock's warper on the engine's logits"),
    "epsilon_cutoff": (SERVED, "stock's warper on the engine's logits"),
    "eta_cutoff": (SERVED, "stock's warper on the engine's logits"),
    "repetition_penalty": (SERVED, "native penalty"),
    "encoder_repetition_penalty": (SERVED, "stock's processor (on the prompt, as stock does)"),
    "length_penalty": (SERVED, "beam search's scoring, stock's code"),
    "no_repeat_ngram_size": (SERVED, "stock's processor on the engine's logits"),
    "encoder_no_repeat_ngram_size": (SERVED, "stock's processor (stock's errors included)"),
    "bad_words_ids": (SERVED, "stock's processor on the engine's logits"),
    "sequence_bias": (SERVED, "stock's processor on the engine's logits"),
    "suppress_tokens": (SERVED, "stock's processor on the engine's logits"),
    "begin_suppress_tokens": (SERVED, "stock's processor on the engine's logits"),
    "forced_bos_token_id": (SERVED, "stock's processor on the engine's logits"),
    "forced_eos_token_id": (SERVED, "stock's processor on the engine's logits"),
    "exponential_decay_length_penalty": (SERVED, "stock's processor on the engine's logits"),
    "renormalize_logits": (SERVED, "stock's processor on the engine's logits"),
    "remove_invalid_values": (SERVED, "stock's processor on the engine's logits"),
    "watermarking_config": (SERVED, "stock's watermark processor on the engine's logits"),
    "guidance_scale": ("guidance_scale", "classifier-free guidance runs a second model pass"),
    "token_healing": ("token_healing", "it rewrites the prompt with the tokenizer"),
    # outputs
    "num_return_sequences": (SERVED, "rows repeated as stock repeats them"),
    "return_dict_in_generate": (SERVED, "stock's output class, with stock's cache"),
    "output_scores": (SERVED, "processed scores of every step"),
    "output_logits": (SERVED, "raw logits of every step"),
    "output_attentions": (
        "output_attentions",
        "attention weights of every layer and step: the engine's attention kernels never "
        "materialise the [heads, query, key] weights",
    ),
    "output_hidden_states": (
        "output_hidden_states",
        "stock returns every layer's hidden states at every step; a last-layer-only answer "
        "would not be stock's structure",
    ),
    # special tokens
    "pad_token_id": (SERVED, "pads finished rows, as stock"),
    "bos_token_id": (SERVED, "a call without input starts from it, as stock"),
    "eos_token_id": (SERVED, "every EOS id stops a row (EosTokenCriteria)"),
    "decoder_start_token_id": (
        SERVED,
        "read by encoder-decoder models only, which run stock ('encoder_decoder')",
    ),
    # assisted decoding (assisted.py)
    "prompt_lookup_num_tokens": (SERVED, "prompt lookup as the engine's n-gram proposer"),
    "max_matching_ngram_size": (SERVED, "the n-gram proposer's match length"),
    "num_assistant_tokens": (SERVED, "the draft proposer's tokens per step"),
    "num_assistant_tokens_schedule": (SERVED, "the draft proposer's schedule"),
    "assistant_confidence_threshold": (SERVED, "the draft proposer's early stop"),
    "assistant_lookbehind": (
        SERVED,
        "read by universal assisted decoding only, which runs stock ('universal_assisted')",
    ),
    "target_lookbehind": (
        SERVED,
        "read by universal assisted decoding only, which runs stock ('universal_assisted')",
    ),
    "assistant_early_exit": ("assistant_early_exit", "drafts with the model's own early layers"),
    "assistant_ensemble_weight": ("assistant_ensemble_weight", "verifies against a model mix"),
    "is_assistant": (SERVED, "set by stock on an assistant's own config; read by its cache"),
    "speculation_type": ("assisted_mtp", "multi-token prediction heads draft the candidates"),
    "use_mtp": ("assisted_mtp", "multi-token prediction heads draft the candidates"),
}

# generate's own arguments (besides generation_config and the options above)
GENERATE_ARGUMENTS: dict[str, tuple[str, str]] = {
    "inputs": (SERVED, "input_ids (a 2-D id tensor); see inputs_embeds below"),
    "generation_config": (SERVED, "merged with the model's and the call's options by stock"),
    "logits_processor": (SERVED, "stock's loop body on the engine's logits (external.py)"),
    "stopping_criteria": (SERVED, "checked every step of the external loop"),
    "prefix_allowed_tokens_fn": (SERVED, "stock's processor on the engine's logits"),
    "synced_gpus": ("synced_gpus", "DeepSpeed ZeRO-3 lockstep across processes"),
    "assistant_model": (
        SERVED,
        "a draft model on its own engine; 'assisted_self', 'assisted_observed' name the rest",
    ),
    "streamer": (SERVED, "fed every step, as stock feeds it (not with beams: 'streamer')"),
    "negative_prompt_ids": ("guidance_scale", "a negative prompt needs a second model pass"),
    "negative_prompt_attention_mask": ("guidance_scale", "as negative_prompt_ids"),
    "custom_generate": ("custom_generate", "it replaces the decoding loop"),
    # model inputs passed through **kwargs
    "attention_mask": (
        "served | right_padding | attention_mask",
        "left padding is served; right padding runs stock (stock predicts the next token from "
        "a pad position and restarts positions after the pads); values other than 0 and 1 run "
        "stock",
    ),
    "cache": (
        "served | past_key_values | recurrent_cache",
        "a DynamicCache with input_ids holding the whole sequence is served and filled in place; "
        "a legacy tuple, another cache class or batch, a cache that is not this model's KV of "
        "input_ids' first tokens, or a model with recurrent layers other than Gated DeltaNet run "
        "stock",
    ),
    "inputs_embeds": (
        "served | inputs_embeds",
        "prefill from the rows, decode from ids (with or without input_ids; only the new tokens "
        "come back without them, as stock); with beams or assisted decoding, or input_ids of "
        "another length, it runs stock",
    ),
    "use_cache": (SERVED, "as the option above"),
    "logits_to_keep": (SERVED, "the engine computes the last position's logits only"),
    "tokenizer": (SERVED, "stop strings are matched with it, as stock"),
}


def fallback_keys(status: str) -> list[str]:
    """The reason keys a status names (none for ``"served"``)."""
    return [k.strip() for k in status.split("|") if k.strip() != SERVED]


def shown(status: str) -> str:
    """How docs/generate_options.md shows a status."""
    keys = ", ".join(f"`{k}`" for k in fallback_keys(status))
    if not keys:
        return SERVED
    return f"served; else falls back: {keys}" if SERVED in status else f"falls back: {keys}"


__all__ = ["GENERATE_ARGUMENTS", "GENERATION_CONFIG_OPTIONS", "SERVED", "fallback_keys", "shown"]
