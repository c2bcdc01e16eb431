"""Which HF causal-LM class the generic path builds for a config, and the reasons it refuses
one before building anything (the profile pass finds the rest, see ``profile.py``).

Every refusal is an ``UnsupportedModelError`` (a ``ValueError``) whose message names the reason;
the integration turns it into a ``PagedFallbackWarning`` and runs stock ``generate``.
"""

from __future__ import annotations

import functools
import inspect
import sys

from hf_paged.models.protocol import UnsupportedModelError
from hf_paged.refusal import Refusal

# config keys whose truthy value means layers the paged attention cannot run
_REFUSED_CONFIG_KEYS = {
    "num_kv_shared_layers": "layers that share another layer's KV cache",
    "use_alibi": "ALiBi position biases",
    "alibi": "ALiBi position biases",
    "position_embedding_type_relative": "relative position biases",
}
# refused keys an adapted class (``adapters/``) implements itself
_ADAPTER_CONFIG_KEYS = {"use_alibi", "alibi"}
# layer_types entries the paged attention runs; anything else (mamba, linear attention, conv...)
# is refused by name
_ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention", "attention", "global", "local"}


def resolve_hf_class(hf_config):
    """The transformers class the generic path builds: ``config.architectures[0]`` when it is a
    causal LM class of transformers, else the causal-LM mapping's class for ``model_type``.

    Raises:
        UnsupportedModelError: neither names a transformers causal LM.
    """
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    archs = getattr(hf_config, "architectures", None) or []
    if archs and archs[0] in causal and hasattr(transformers, archs[0]):
        return getattr(transformers, archs[0])
    vlm = image_text_class(hf_config)
    if vlm is not None:
        return vlm
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(hf_config, "model_type", None))
    if name is None or not hasattr(transformers, name):
        what = archs[0] if archs else getattr(hf_config, "model_type", None)
        raise UnsupportedModelError(
            f"{what!r} is not a transformers causal LM (not in MODEL_FOR_CAUSAL_LM_MAPPING)"
        )
    return getattr(transformers, name)


# vision-language families whose stock merge (image features into placeholder runs, in
# ``masked_scatter`` order) and positions the paged path reproduces, each checked token for token
# against stock (tests/integration/multimodal; the second group by the coverage table,
# tests/models/coverage_vlm.py: a left-padded batch with two images, in one step and in prefill
# chunks smaller than an image); any other family runs stock by name until it is checked
VERIFIED_IMAGE_TEXT = frozenset({
    "llava", "llava_next", "llava_onevision", "mistral3", "idefics3", "smolvlm", "llama4",
    "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "gemma3",
    "aya_vision", "cohere2_vision", "got_ocr2", "pp_chart2table", "internvl", "qianfan_ocr",
    "lighton_ocr", "llava_next_video", "video_llava", "vipllava", "qwen3_vl_moe", "shieldgemma2",
})  # fmt: skip


def image_text_class(hf_config):
    """The transformers ``*ForConditionalGeneration`` class of a vision-language config
    (``AutoModelForImageTextToText``'s), or None. The generic path builds the whole model and
    serves its decoder; the vision tower runs stock in the caller's process
    (``integration/multimodal``)."""
    import transformers
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES as names,
    )

    archs = getattr(hf_config, "architectures", None) or []
    name = archs[0] if archs and archs[0] in set(names.values()) else None
    if name is None:
        name = names.get(getattr(hf_config, "model_type", None))
    if name is None or not hasattr(transformers, name):
        return None
    cls = getattr(transformers, name)
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return cls if text is not hf_config else None  # a VLM has a text config of its own


# vision-language families whose decoder positions are not the engine's (PaliGemma's start at 1)
_ONE_BASED_POSITIONS = {"paligemma": "PaliGemma"}


# transformers' task mappings whose classes are no causal LM: a checkpoint saved as one of them
# (``BertModel``, ``T5ForConditionalGeneration``, ...) has no next-token head to generate with
_NOT_CAUSAL_MAPPINGS = (
    "MODEL_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES",
    "MODEL_FOR_TEXT_ENCODING_MAPPING_NAMES", "MODEL_FOR_PRETRAINING_MAPPING_NAMES",
)  # fmt: skip


def checkpoint_class_refusal(hf_config) -> Refusal | None:
    """Why a checkpoint directory is no causal LM by the class it was saved as
    (``config.architectures[0]``, e.g. ``BertModel``; reason "architecture"), or None. Only for checkpoints on disk:
    an in-memory model is judged by its own class, whatever its config names.

    Loading such a checkpoint as its family's causal LM (``BertLMHeadModel``) would start from
    a head the checkpoint does not have, so it is refused before any weight is read.
    """
    from transformers.models.auto import modeling_auto

    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        return None
    name = archs[0]
    generates = (
        *modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values(),
        *modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.values(),  # image_text_class
    )
    if name in generates:
        return None
    for mapping in _NOT_CAUSAL_MAPPINGS:
        classes = getattr(modeling_auto, mapping, {}).values()
        if any(name == c or (isinstance(c, tuple) and name in c) for c in classes):
            return Refusal("architecture", (
                f"{name!r} is not a transformers causal LM (the checkpoint was saved as "
                f"{name}, not in MODEL_FOR_CAUSAL_LM_MAPPING): it has no next-token head to "
                "generate with"
            ))  # fmt: skip
    return None


def static_refusal(hf_config) -> Refusal | None:
    """Why the generic path refuses ``hf_config`` without building it (reason "architecture"),
    or None. What depends on the engine's ``max_model_len`` (``length_refusal``) is checked when
    the model is built."""
    return _config_refusal(hf_config) or _unverified_image_text_refusal(hf_config)


def _unverified_image_text_refusal(hf_config) -> Refusal | None:
    """Why a vision-language family the paged path has not been checked on runs stock."""
    cls = image_text_class(hf_config)
    model_type = getattr(hf_config, "model_type", None)
    if cls is None or model_type in VERIFIED_IMAGE_TEXT:
        return None
    return Refusal(
        "architecture",
        f"{cls.__name__}: the paged path has not been checked against stock for the "
        f"{model_type!r} vision-language family (served: {sorted(VERIFIED_IMAGE_TEXT)})",
    )


def _config_refusal(hf_config) -> Refusal | None:
    """Why the config's class, layers or fields are ones the generic path does not serve."""
    try:
        cls = resolve_hf_class(hf_config)
    except UnsupportedModelError as e:
        return Refusal("architecture", str(e))
    name = cls.__name__
    if getattr(hf_config, "is_encoder_decoder", False):
        return Refusal("architecture", f"{name} is an encoder-decoder")
    recurrent = _recurrent_classes(cls)
    missing = _unserved(recurrent)
    if missing:
        return Refusal(
            "architecture",
            f"{name} has recurrent layers no mixer serves yet (hybrid/recurrent): "
            f"{', '.join(missing)}",
        )
    # a model of recurrent layers alone has no attention at all (Mamba): the profile pass checks
    if not recurrent and not _uses_attention_interface(cls):
        return Refusal(
            "architecture",
            f"{name} does not route attention through transformers' AttentionInterface",
        )
    from hf_paged.layers.quantization import unserved_quantization

    quantized = unserved_quantization(hf_config)
    if quantized is not None:
        return Refusal(
            "architecture",
            f"{name} has a quantization_config ({quantized[0]}) the engine does not serve",
        )
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    vlm = image_text_class(hf_config) is cls
    if text is not hf_config and text.model_type != hf_config.model_type and not vlm:
        return Refusal(
            "architecture", f"{name} is multimodal (text config {text.model_type!r} inside)"
        )
    if vlm:
        from hf_paged.models.image_masks import image_mask_rule

        rule = image_mask_rule(hf_config)  # bidirectional image blocks: served as ranges
        if isinstance(rule, Refusal):
            return Refusal("architecture", f"{name}: {rule.detail}")
        family = _ONE_BASED_POSITIONS.get(getattr(hf_config, "model_type", None))
        if family is not None:
            return Refusal(
                "architecture",
                f"{name}: {family}'s decoder positions start at 1; the engine's start at 0",
            )
    adapted = _adapted(cls)
    for key, what in _REFUSED_CONFIG_KEYS.items():
        if key in _ADAPTER_CONFIG_KEYS and adapted:
            continue  # the adapter passes the slopes to the paged attention
        if getattr(text, key, None):
            return Refusal("architecture", f"{name} has {what} ({key}={getattr(text, key)!r})")
    types = getattr(text, "layer_types", None) or []
    runs = _ATTENTION_LAYER_TYPES | ({"chunked_attention"} if _chunk_size(text) else set())
    other = sorted({t for t in types if isinstance(t, str)} - runs)
    if other and not recurrent:  # with mixers: the profile pass finds what nothing runs
        return Refusal(
            "architecture", f"{name} has layers the paged attention cannot run: layer_types {other}"
        )
    return None


@functools.cache
def _uses_attention_interface(cls) -> bool:
    """The class says so (``_supports_attention_backend``), an adapter serves it
    (``adapters/``), or its modeling module looks the attention function up in
    ``ALL_ATTENTION_FUNCTIONS`` (the profile pass then checks that every attention call
    arrives)."""
    if getattr(cls, "_supports_attention_backend", False):
        return True
    from hf_paged.models.generic.adapters import serves

    if serves(cls):  # its attention modules get an adapter that calls the paged attention
        return True
    try:
        source = inspect.getsource(sys.modules[cls.__module__])
    except (OSError, TypeError, KeyError):
        return True  # cannot tell: the profile pass decides
    return "ALL_ATTENTION_FUNCTIONS" in source


def _recurrent_classes(cls) -> set[str]:
    """Names of the recurrent layer classes (``models/recurrent/registry.py``) that ``cls``'s
    modeling module defines."""
    from hf_paged.models.recurrent.registry import MIXERS

    module = sys.modules.get(cls.__module__)
    return {n for n in MIXERS if module is not None and hasattr(module, n)}


def _unserved(names: set[str]) -> list[str]:
    from hf_paged.models.recurrent.registry import unserved

    return unserved(names)


def _adapted(cls) -> bool:
    from hf_paged.models.generic.adapters import serves

    return serves(cls)


def _chunk_size(text) -> int | None:
    return getattr(text, "attention_chunk_size", None) or None


def length_refusal(hf_config, max_model_len: int | None) -> Refusal | None:
    """Why the generic path refuses ``hf_config`` for sequences of up to ``max_model_len``
    tokens (None: not known, which refuses what depends on it), or None.

    * Chunked attention (Llama 4's ``attention_chunk_size``) attends within chunks of
      positions; when every position the engine runs falls in the first chunk it is causal
      attention over the whole sequence, which the paged attention runs.
    * Llama 4's attention temperature tuning scales NoPE layers' queries by
      ``1 + attn_scale * log1p((i + 1) // floor_scale)`` with ``i`` the token's index in the
      row HF runs (our flattened row holds many sequences): while every position is below
      ``floor_scale - 1`` stock's scale is 1, and its adapter (``adapters/llama4.py``) runs
      with scale 1 too.
    """
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    name = resolve_hf_class(hf_config).__name__
    chunk = _chunk_size(text)
    if chunk and (max_model_len is None or max_model_len > chunk):
        return Refusal(
            "architecture",
            f"{name} has chunked attention (attention_chunk_size={chunk}), served only while one "
            f"chunk holds the whole sequence: max_model_len={max_model_len} must be <= {chunk}",
        )
    floor_scale = getattr(text, "floor_scale", None)
    nope = 0 in (getattr(text, "no_rope_layers", None) or [])
    if getattr(text, "attn_temperature_tuning", False) and nope and floor_scale:
        if max_model_len is None or max_model_len >= floor_scale:
            return Refusal(
                "architecture",
                f"{name} has attention temperature tuning on NoPE layers (floor_scale="
                f"{floor_scale}), served only while it scales by 1: max_model_len="
                f"{max_model_len} must be < {floor_scale}",
            )
    return None


def check_supported(hf_config, max_model_len: int | None = None) -> None:
    """Raises ``UnsupportedModelError`` with ``static_refusal``'s or ``length_refusal``'s text
    (for an engine of ``max_model_len`` tokens; None: not known), if any."""
    reason = static_refusal(hf_config) or length_refusal(hf_config, max_model_len)
    if reason is not None:
        raise UnsupportedModelError(reason.detail)
