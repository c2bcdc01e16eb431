"""Every architecture in transformers' ``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, built tiny
from its own config, run through ``generate(backend="paged")`` with images and compared with stock
greedy on each row alone.

Each architecture ends as one of:
  served     the engine ran it and every row's tokens equal stock's
  fallback   the engine refused it (``PagedFallbackWarning``) and stock ran; the reason is kept
  failure    paged tokens differ from stock's, or the paged call raised
  no_build   its config does not build tiny with the shared tiny sizes, or stock itself cannot
             run the hand-made image inputs (not counted; the error is kept)

The tiny models come from ``hf_paged.testing.vlm`` (its families with their own fields; any other
family: the same text and vision sizes passed to its own config class), the image inputs from
its ``image`` / ``batch`` (placeholder runs counted as stock's ``get_image_features`` gives
rows). Rows: two images of different content and a text-only row, left padded; run in one
step and again with prefill chunks of 3 tokens (smaller than any image).

``python -m tests.models.coverage_vlm [--write FILE] [model_type ...]`` prints the table.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch

from tests.models import coverage_report as report

NEW = 6
ENGINE = dict(kv_block_size=4, num_kv_blocks=256, max_model_len=160)
CRAMPED = dict(ENGINE, max_num_batched_tokens=3, max_num_seqs=2)  # chunks < one image
MAX_PARAMS = 20_000_000  # a family whose other sub-configs stay full size does not build tiny
# families whose config and inputs follow a family of ``testing/vlm.py``: built with that
# family's sizes (and these extra keys) in their own config class, images made as for it
TEMPLATES = {
    "shieldgemma2": ("gemma3", {}),
    "vipllava": ("llava", {"vision_feature_layers": [-1, -2]}),
    "llava_next_video": ("llava_next", {}),
    "lighton_ocr": ("mistral3", {}),
    "qwen3_vl_moe": ("qwen3_vl", {}),
    "aya_vision": ("llava", {}),
    "cohere2_vision": ("llava", {}),
}


def image_text_entries() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items())


def build(model_type: str):
    """The tiny model of ``model_type``: ``testing/vlm.py``'s family, or the shared sizes in the
    family's own config class."""
    from transformers import CONFIG_MAPPING, AutoModelForImageTextToText

    from hf_paged.testing import vlm

    if model_type in vlm.FAMILIES:
        return vlm.build_tiny_vlm(model_type)
    if model_type in TEMPLATES:
        family, extra = TEMPLATES[model_type]
        text, vision, top = vlm.FAMILIES[family]
        top = {k: v for k, v in top.items() if k != "vision_feature_layer" or not extra}
        config = CONFIG_MAPPING[model_type](text_config=dict(text), vision_config=dict(vision),
                                           **{**top, **extra})  # fmt: skip
        torch.manual_seed(0)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
        from hf_paged.testing.models import randomize_

        return _As(randomize_(model, 0).eval(), family)
    config = CONFIG_MAPPING[model_type](text_config=dict(vlm._TEXT), vision_config=dict(vlm._VISION),
                                       image_token_id=vlm.IMAGE_TOKEN)  # fmt: skip
    with torch.device("meta"):  # sub-configs the shared sizes do not reach may be full size
        size = sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())
    if size > MAX_PARAMS:
        raise ValueError(f"{size / 1e6:.0f}M parameters with the tiny text and vision sizes")
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    from hf_paged.testing.models import randomize_

    return randomize_(model, 0).eval()


class _As:
    """A model seen as ``family`` by ``testing/vlm.py``'s input builders (they pick the image
    layout by ``config.model_type``); everything else is the model's own."""

    def __init__(self, model, family: str):
        self.__dict__["_model"], self.__dict__["config"] = model, _ConfigAs(model.config, family)

    def __getattr__(self, name):
        return getattr(self._model, name)


class _ConfigAs:
    def __init__(self, config, family: str):
        self.__dict__["_config"], self.__dict__["model_type"] = config, family

    def __getattr__(self, name):
        return getattr(self._config, name)


def run_arch(model_type: str, class_name: str) -> report.ArchResult:
    from hf_paged import PagedFallbackWarning
    from hf_paged.integration.fallback import reset_fallback_warnings
    from hf_paged.testing import vlm

    t0 = time.perf_counter()
    res = report.ArchResult(model_type, class_name, "no_build")
    try:
        built = build(model_type)
        model = getattr(built, "_model", built)  # what generate runs on
        rows = [[[5, 6, 7], vlm.image(built, 1), [8, 9]], [[10], vlm.image(built, 2), [11, 12]],
                [[20, 21, 22]]]  # fmt: skip
        ref = vlm.stock_greedy(built, rows, NEW)
        kw = vlm.batch(built, rows)
    except Exception as e:  # noqa: BLE001  recorded, not counted
        res.detail = f"{type(e).__name__}: {report.short(e)}"
        res.seconds = time.perf_counter() - t0
        return res
    reset_fallback_warnings()
    with report.paged_run(res, model, t0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            out = model.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                                 pad_token_id=0, backend="paged", paged_config=ENGINE)  # fmt: skip
            fell = [w for w in caught if issubclass(w.category, PagedFallbackWarning)]
            got = out[:, kw["input_ids"].shape[1] :].tolist()
            cramped = None
            if not fell and got == ref:  # prefill chunks smaller than an image, same model
                out = model.generate(**kw, max_new_tokens=NEW, min_new_tokens=NEW,
                                     do_sample=False, pad_token_id=0, backend="paged",
                                     paged_config=CRAMPED)  # fmt: skip
                cramped = out[:, kw["input_ids"].shape[1] :].tolist()
                fell = [w for w in caught if issubclass(w.category, PagedFallbackWarning)]
        if fell:
            res.status, res.detail = "fallback", report.short(str(fell[0].message), 300)
        elif got != ref:
            bad = [i for i, (a, b) in enumerate(zip(ref, got)) if a != b]
            res.status, res.detail = "failure", f"tokens differ in rows {bad}"
        elif cramped != ref:
            bad = [i for i, (a, b) in enumerate(zip(ref, cramped)) if a != b]
            res.status, res.detail = "failure", f"prefill chunks of 3: tokens differ in rows {bad}"
        else:
            res.status, res.detail = "served", "identical"
    return res


def run_all(model_types: list[str] | None = None) -> list[report.ArchResult]:
    entries = image_text_entries()
    if model_types:
        entries = [e for e in entries if e[0] in model_types]
    return [run_arch(mt, cls) for mt, cls in entries]


def markdown_table(results: list[report.ArchResult]) -> str:
    import transformers

    c = report.summary(results)
    lines = [
        f"Image-text-to-text: {c['served']} of {c['built']} architectures that build tiny are "
        f"served identical, {c['fallback']} fall back with a named reason, {c['failure']} fail, "
        f"{c['no_build']} do not build tiny (not counted). Tiny fp32 models (text hidden 64, 2 "
        f"layers; vision hidden 32), two images and a text-only row, left padded, {NEW} greedy "
        f"tokens, stock each row alone; transformers {transformers.__version__}.",
        "",
        *report.table_rows(results),
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(prog="python -m tests.models.coverage_vlm")
    p.add_argument("--write", default=None, help="also write the table to this file")
    p.add_argument("model_types", nargs="*", help="default: every image-text-to-text entry")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    results = []
    for mt, cls in image_text_entries():
        if args.model_types and mt not in args.model_types:
            continue
        r = run_arch(mt, cls)
        results.append(r)
        report.print_row(r)
    report.print_table(markdown_table(results), args.write)


if __name__ == "__main__":
    main(sys.argv[1:])
