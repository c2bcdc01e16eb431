"""Which vision-language families attend bidirectionally inside an image, and where.

Most families keep their decoder causal over image tokens. A few build stock masks that let a
block of prompt tokens see each other both ways (transformers' ``blockwise_overlay`` over
``block_sequence_ids``), at prefill only. The engine serves that as bidirectional ranges
(``attention/bidirectional.py``): each request's ranges are found once at admission from the
row of type ids the processor made (left padding stripped), and the scheduler keeps each range
in one prefill chunk. What the ranges cannot express is refused by name.

Rules, read from each family's ``modeling_*.py`` in transformers 5.25:

- ``gemma3`` (and ``shieldgemma2``, the same class): runs of ``token_type_ids == 1`` (one block per run of image tokens); full layers
  OR(causal, block), sliding layers AND(window, OR(causal, block)).
- ``gemma4`` / ``gemma4_unified``: runs of ``mm_token_type_ids`` in {1, 2} (image or video)
  when the text config says ``use_bidirectional_attention == "vision"``; sliding layers only,
  the full layers stay causal.
- ``paligemma``: the prefix, ``token_type_ids == 0``, is one block (image and prompt). Its
  sliding layers (PaliGemma 2) OR the block with the window instead of AND: refused.
- Families whose stock mask has blocks this table does not describe are refused by name.

Without the type ids in the call (stock then builds a causal mask) there are no ranges.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hf_paged.refusal import Refusal


@dataclass(frozen=True)
class ImageMaskRule:
    """How one family's stock mask opens blocks of prompt tokens."""

    type_ids_key: str  # the ``generate`` keyword whose row marks the block tokens
    block_types: frozenset[int]  # type ids inside a block
    sliding_only: bool  # the blocks open the sliding layers only (full layers stay causal)
    one_block: bool  # all block tokens are one block (else one per run)


_RULES = {
    "gemma3": ImageMaskRule("token_type_ids", frozenset({1}), False, False),
    "shieldgemma2": ImageMaskRule("token_type_ids", frozenset({1}), False, False),  # Gemma 3's
    "gemma4": ImageMaskRule("mm_token_type_ids", frozenset({1, 2}), True, False),
    "gemma4_unified": ImageMaskRule("mm_token_type_ids", frozenset({1, 2}), True, False),
    "paligemma": ImageMaskRule("token_type_ids", frozenset({0}), False, True),
}
# families whose stock masks have blocks of another shape (not served as ranges yet)
_OTHER_BLOCKS = ("molmo2", "git", "deepseek_ocr2", "pi0", "pi05", "unlimited_ocr",
                 "diffusion_gemma")  # fmt: skip


def image_mask_rule(config) -> ImageMaskRule | Refusal | None:
    """The rule of ``config``'s family (a composite VLM config), None for a causal decoder, or
    a ``Refusal`` when its stock mask is bidirectional in a way ranges cannot express."""
    model_type = getattr(config, "model_type", None)
    if model_type in _OTHER_BLOCKS:
        return Refusal(
            "bidirectional_mask",
            f"{model_type!r} builds a block mask over its prompt that the engine's bidirectional "
            "ranges do not describe yet; it runs stock",
        )
    rule = _RULES.get(model_type)
    if rule is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if model_type.startswith("gemma4") and text.use_bidirectional_attention != "vision":
        return None
    if model_type == "paligemma" and getattr(text, "sliding_window", None) is not None:
        return Refusal(
            "bidirectional_mask",
            "PaliGemma with a sliding-window text model (PaliGemma 2) ORs its prefix block with "
            "the window on sliding layers; the engine's ranges AND them: it runs stock",
        )
    return rule


def bidirectional_ranges(
    rule: ImageMaskRule, type_ids: Sequence[int] | None
) -> list[tuple[int, int]] | Refusal:
    """One prompt's ranges ``(start, end)`` from its row of type ids (left padding stripped;
    None: the call passed none, so stock's mask is causal)."""
    if type_ids is None:
        return []
    runs: list[tuple[int, int]] = []
    start = None
    for pos, t in enumerate(list(type_ids) + [None]):
        inside = t in rule.block_types
        if inside and start is None:
            start = pos
        elif not inside and start is not None:
            runs.append((start, pos))
            start = None
    if rule.one_block and len(runs) > 1:
        return Refusal(
            "bidirectional_mask",
            f"{rule.type_ids_key} makes {len(runs)} separate runs of one block (prefix tokens "
            "after suffix tokens); the engine's ranges are contiguous: it runs stock",
        )
    return runs


def layer_specs_for(rule: ImageMaskRule | None, specs: list) -> list:
    """``specs`` (``AttentionLayerSpec`` per layer) with ``bidirectional`` set as ``rule`` says:
    every layer, or (``sliding_only``) the sliding-window layers alone."""
    import dataclasses

    if rule is None or not rule.sliding_only:
        return list(specs)
    return [dataclasses.replace(s, bidirectional=s.sliding_window is not None) for s in specs]
