"""``Refusal``: the one answer to "why can't this run on the paged engine?".

Every helper that judges a call, a model, a config or an option returns ``Refusal | None``
(None: it can run). The caller decides what a refusal becomes: the ``generate`` dispatcher and
the other front ends with a stock implementation raise it as ``PagedFallback`` and run stock
(``integration/fallback.py``); the engine and ``LLM``, which have nothing to fall back on, raise
``ValueError`` (or ``UnsupportedModelError``) with its text.

A plain value with no imports, so every level of the package (layers, models, engine,
integration) returns the same type.

``REASONS`` is the one list of reason keys, each with what a user can do about it
(``docs/fallbacks.md`` shows it as a table); ``REASON_FAMILIES`` the key prefixes whose rest is
named where the refusal is made (a PEFT layer kind, a quantization method, an assistant's own
reason). ``tests/test_package_layout.py`` holds every key the code makes to these two lists, so
a new key is a decision someone saw.
"""

from __future__ import annotations

from typing import NamedTuple


class Refusal(NamedTuple):
    """Why something can't run paged.

    A named pair, so ``reason, detail = refusal`` unpacks it; ``str(refusal)`` is the detail
    alone (what a ``ValueError`` built from it says).
    """

    reason: str  # short key, e.g. "quantized_gptq", "architecture": one warning per key
    detail: str  # why, in words, and how to change the call where there is a way

    def __str__(self) -> str:
        return self.detail

    def tagged(self) -> str:
        """``"detail [reason]"``: the detail with its key, as error messages show both."""
        return f"{self.detail} [{self.reason}]"

    def renamed(self, prefix: str, what: str) -> Refusal:
        """The same refusal about a second object: ``prefix`` on the key and ``what`` before the
        detail (an assistant model's refusal as ``assistant_...``, "the assistant: ...")."""
        return Refusal(f"{prefix}{self.reason}", f"{what}{self.detail}")


# reason key -> what a user can do about it
REASONS: dict[str, str] = {
    # the call: arguments and generation options
    "attention_mask": "pass a 2-D mask of 0s and 1s of input_ids' shape",
    "cache_implementation": "drop cache_implementation='paged' (it selects transformers' own)",
    "contrastive_search": "nothing: contrastive search runs stock",
    "constrained_beam_search": "nothing: constrained beams are hub custom_generate code",
    "custom_generate": "nothing: custom_generate replaces the decoding loop",
    "dola_generation": "nothing: DoLa decoding runs stock",
    "empty_prompt": "give every row at least one attended token",
    "group_beam_search": "nothing: group beams are hub custom_generate code",
    "guidance_scale": "drop guidance_scale / the negative prompt (a second model pass)",
    "inputs_embeds": "pass input_ids instead of inputs_embeds",
    "logits_processor": "drop the logits processors the engine does not implement",
    "low_memory": "drop low_memory=True (stock refuses it too)",
    "max_length": "pass max_gen_toks instead of max_length in lm-eval's gen_kwargs",
    "model_kwargs": "drop the extra model inputs (position_ids, token_type_ids ...)",
    "output_attentions": "drop output_attentions=True (it needs the model's own forward)",
    "output_hidden_states": "drop output_hidden_states=True (it needs the model's own forward)",
    "past_key_values": "pass a DynamicCache this model filled for input_ids' first tokens, or none",
    "recurrent_cache": "drop return_dict_in_generate's cache (or the cache passed in) for a "
    "model with recurrent layers",
    "returned_cache": "nothing: this engine cannot read its KV blocks back",
    "returned_cache_fp8": "build the engine with kv_cache_dtype='auto' to get the cache back",
    "returned_cache_layers": "nothing: the engine's KV layers are not stock's cache layers",
    "returned_cache_tp": "use tensor_parallel_size=1 to get the cache back",
    "video_inputs": "nothing yet: video inputs run stock",
    "right_padding": "pad on the left (tokenizer.padding_side = 'left')",
    "streamer": "drop the streamer from a beam call",
    "synced_gpus": "drop synced_gpus=True",
    "token_healing": "drop token_healing=True",
    "universal_assisted": "use an assistant with the model's tokenizer",
    # assisted decoding
    "assistant_early_exit": "use an assistant model or prompt lookup instead of early exit",
    "assistant_ensemble_weight": "drop assistant_ensemble_weight",
    "assistant_model": "pass an HF model or a PagedModelForCausalLM as assistant_model",
    "assistant_vocab": "use an assistant with the model's vocabulary",
    "assisted_gemma4": "nothing: Gemma 4 assistants draft from shared KV",
    "assisted_mtp": "nothing: multi-token prediction heads run stock",
    "assisted_observed": "drop the streamer, scores, processors or criteria of an assisted call",
    "assisted_processors": "drop the logits processors or criteria of an assisted call",
    "assisted_rows": "call generate itself (one assistant per call), not a many-prompt front end",
    "assisted_self": "pass another model as assistant_model",
    "assisted_stop_strings": "drop stop strings from an assisted call",
    "beam_search": "nothing: this engine has no beams",
    # the model
    "bidirectional_mask": "nothing yet: this model's bidirectional image mask runs stock",
    "architecture": "see the detail: a model family or layer the engine does not serve yet",
    "custom_modules": "use the transformers class itself, not a subclass of its modules",
    "device": "put the whole model on one CPU or CUDA device",
    "dtype": "load the model in float32 or bfloat16 (float16 too on CUDA)",
    "encoder_decoder": "nothing: encoder-decoder models run stock",
    "fp8_layout": "load with model_impl='generic' (HF's unfused modules hold this FP8 layout)",
    "hidden_act": "load with model_impl='generic'",
    "module_hooks": "remove the forward hooks (they would not run in the engine)",
    "patched_forward": "remove the forward set on the instance",
    "prepare_inputs_override": "restore the model's prepare_inputs_for_generation",
    "recurrent_assisted": "nothing: a recurrent state cannot take back rejected tokens",
    "recurrent_beams": "nothing yet: beams of recurrent models run stock",
    "rope": "load with model_impl='generic'",
    "tensor_parallel_size": "pick a tensor_parallel_size the detail allows",
    "training_mode": "call model.eval() (dropout is on in training mode)",
    # sizes
    "kv_cache": "give the engine more KV blocks (num_kv_blocks, gpu_memory_utilization)",
    "max_model_len": "lower max_new_tokens, or build the engine with a larger max_model_len",
    "rope_length": "keep rows under the length at which the model's rope scaling changes",
    # who runs it
    "autocast": "see the detail: mixed precision the engine does not reproduce (lm-eval's "
    "mixed_precision_dtype, an fp16 or CUDA autocast)",
    "data_parallel": "run lm-eval on one rank per engine",
    "reentrant": "do not call generate from inside a paged call on the same model",
    "seq2seq": "nothing: lm-eval's seq2seq models run stock",
    "lora_slots": "build the engine with a max_lora_rank that holds the adapter's rank",
    # internal: never a fallback a user sees
    "cuda_graph": "(internal) why decode runs eagerly; stats and logs name it",
    "external_sampling": "(internal) the call samples outside the engine, still paged",
    # why a PEFT model's adapters are merged into the weights instead of served from LoRA slots
    "lora_hooks": "(internal) adapters merged, not served from slots: forward hooks on a layer",
    "lora_layer": "(internal) adapters merged, not served from slots: a layer is not LoRA Linear",
    "lora_merged": "(internal) adapters merged, not served from slots: merged already",
    "lora_target": "(internal) adapters merged, not served from slots: a layer the slots lack",
    "lora_variant": "(internal) adapters merged, not served from slots: a variant or a bias",
    "no_adapters": "(internal) the model has no PEFT layers: nothing to serve from slots",
}
# key prefix -> what a user can do; the key's rest is named where the refusal is made
REASON_FAMILIES: dict[str, str] = {
    "assistant_": "the assistant model's own refusal: see that key",
    "peft_": "merge the adapter (merge_and_unload) or use plain LoRA",
    "quantized_": "load a quantization the engine serves (FP8), or the unquantized model",
}


def is_reason(key: str) -> bool:
    """``key`` is in ``REASONS`` or one of ``REASON_FAMILIES`` (with a non-empty rest)."""
    return key in REASONS or any(
        key.startswith(prefix) and len(key) > len(prefix) for prefix in REASON_FAMILIES
    )


def table() -> str:
    """``REASONS`` and ``REASON_FAMILIES`` as the Markdown table of ``docs/fallbacks.md``."""
    rows = [*REASONS.items(), *((f"{p}*", what) for p, what in REASON_FAMILIES.items())]
    return "\n".join(
        ["| reason | what you can do |", "|---|---|"]
        + [f"| `{key}` | {what} |" for key, what in rows]
    )


__all__ = ["REASONS", "REASON_FAMILIES", "Refusal", "is_reason", "table"]


if __name__ == "__main__":
    print(table())
