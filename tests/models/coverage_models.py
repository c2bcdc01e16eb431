"""Every causal LM in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, built tiny from its
default config, run through ``generate(backend="paged")`` and compared with stock greedy.

Each architecture ends as one of:
  served     the engine ran it and the tokens equal stock's
  fallback   the engine refused it (``PagedFallbackWarning``) and stock ran; the reason is kept
  failure    paged tokens differ from stock's, or the paged call raised
  not_text   not a decoder-only text architecture (encoder-decoder or multimodal): not counted
  no_build   its default config does not build tiny (not counted; the error is kept)

``python -m tests.models.coverage_models [--write FILE] [model_type ...]`` prints the table (and
writes it as markdown). The tiny models come from ``hf_paged.testing.build_tiny`` (the hybrid and
recurrent families with their own fields: ``hf_paged.testing.hybrid_configs``); for a model with
recurrent layers stock's reference is each prompt run alone.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings

import torch

from hf_paged.testing.any_model import HIDDEN, VOCAB, build_tiny
from tests.models import coverage_report as report

BLOCK_SIZE = 4
PROMPT_LENS = (1, 4, 5, 9)  # 1 token, a block boundary, one past it, two blocks + 1
MAX_NEW_TOKENS = 16
# a served model then runs WIDE_COPIES copies of the prompts at once: one prefill step of
# 14 * 19 = 266 tokens, longer than the tiny configs' max_position_embeddings (256), as a step
# of many prompts is for real models (BigBird sliced a buffer by the step's length)
WIDE_COPIES = 14


def causal_lm_entries() -> list[tuple[str, str]]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items())


def not_text_reason(config) -> str | None:
    """Why ``config`` is not a decoder-only text architecture, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    # a sub-config class without a model_type of its own is no model: it configures this
    # model's layers (MPT's and DBRX's attn_config / ffn_config)
    subs = sorted(k for k, v in (getattr(config, "sub_configs", {}) or {}).items()
                  if getattr(v, "model_type", None) != "")  # fmt: skip
    if any(k != "text_config" for k in subs) or (subs and "text_config" not in subs):
        return f"multimodal or composite ({', '.join(subs)})"
    text = getattr(config, "text_config", None)
    if text is not None and getattr(text, "model_type", None) != config.model_type:
        return f"multimodal: a {text.model_type!r} text model inside"
    return None


def prompts(vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ``[B, L]`` ids (no special ids 0-2) and their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(PROMPT_LENS)
    ids = torch.zeros(len(PROMPT_LENS), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENS):
        ids[i, width - n :] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n :] = 1
    return ids, mask


def _generate(model, ids, mask, **kw):
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=MAX_NEW_TOKENS, min_new_tokens=MAX_NEW_TOKENS,
        do_sample=False, pad_token_id=0, **kw,
    )  # fmt: skip


def run_arch(
    model_type: str,
    class_name: str,
    model_impl: str = "auto",
    device: str = "cpu",
    block_size: int = BLOCK_SIZE,
    wide: bool = True,
) -> report.ArchResult:
    """Build, save, reload, and compare paged with stock greedy for one architecture (model,
    prompts and engine on ``device``; KV blocks of ``block_size``: the Triton kernels need at
    least 8, so CUDA runs at 4 use the torch reference attention); then the wide step
    (``WIDE_COPIES``) unless ``wide`` is False."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM

    from hf_paged import PagedFallbackWarning
    from hf_paged.integration.fallback import reset_fallback_warnings

    t0 = time.perf_counter()
    res = report.ArchResult(model_type, class_name, "no_build")
    try:
        config = CONFIG_MAPPING[model_type]()
        why = not_text_reason(config)
        if why is not None:
            res.status, res.detail = "not_text", why
            return res
        _, model = build_tiny(model_type)
        with tempfile.TemporaryDirectory() as d:
            model.save_pretrained(d)
            model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        model = model.to(device)
        ids, mask = (t.to(device) for t in prompts(model.config.get_text_config().vocab_size))
        with torch.no_grad():
            ref = (
                _generate(model, ids, mask)
                if not _recurrent(model)
                else _rows_alone(model, ids, mask)
            )
    except Exception as e:  # noqa: BLE001  recorded, not counted
        res.detail = f"{type(e).__name__}: {report.short(e)}"
        res.seconds = time.perf_counter() - t0
        return res
    reset_fallback_warnings()
    # no prefix caching: the wide step's copies of one prompt each compute all their tokens
    cfg = dict(kv_block_size=block_size, model_impl=model_impl, max_model_len=64,
               num_kv_blocks=64 * WIDE_COPIES, enable_prefix_caching=False, device=device)  # fmt: skip
    with report.paged_run(res, model, t0):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            out = _generate(model, ids, mask, backend="paged", paged_config=cfg)
            fell = [w for w in caught if issubclass(w.category, PagedFallbackWarning)]
            k, wide_out = WIDE_COPIES, None
            if wide and not fell and torch.equal(out, ref):  # the wide step, same engine
                wide_out = _generate(model, ids.repeat(k, 1), mask.repeat(k, 1), backend="paged",
                                 paged_config=cfg)  # fmt: skip
                fell = [w for w in caught if issubclass(w.category, PagedFallbackWarning)]
        if fell:
            res.status, res.detail = "fallback", report.short(str(fell[0].message), 300)
        elif not _engine_ran(model):
            res.status, res.detail = "failure", "no fallback warning, but no engine was built"
        elif not torch.equal(out, ref):
            res.status, res.detail = "failure", _first_diff(ref, out)
        elif wide_out is not None and not torch.equal(wide_out, ref.repeat(k, 1)):
            res.status = "failure"
            res.detail = f"wide step ({k} copies): {_first_diff(ref.repeat(k, 1), wide_out)}"
        else:
            res.status, res.detail = "served", "identical"
    return res


def _recurrent(model) -> bool:
    """Whether ``model`` has recurrent layers (``models/recurrent/registry.py``): stock's
    batched left-padded rows may then differ from the prompts alone (MiniMax: padding flows
    through the recurrence), and the engine has no padding, so each row alone is the oracle."""
    from hf_paged.models.recurrent.registry import recurrent_modules

    return bool(recurrent_modules(model))


def _rows_alone(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Stock greedy on each row's prompt alone, laid out as the batched call's ``[B, L + T]``."""
    rows = []
    for i in range(ids.shape[0]):
        n = int(mask[i].sum())
        alone = _generate(model, ids[i : i + 1, ids.shape[1] - n :], mask[i : i + 1, -n:])
        rows.append(torch.cat([ids[i], alone[0, n:]]))
    return torch.stack(rows)


def _engine_ran(model) -> bool:
    from hf_paged.integration.engine_owner import existing_owner

    owner = existing_owner(model)
    return owner is not None and owner.engine is not None


def _first_diff(ref: torch.Tensor, out: torch.Tensor) -> str:
    if ref.shape != out.shape:
        return f"shape {tuple(out.shape)} != stock {tuple(ref.shape)}"
    rows = (ref != out).any(dim=1).nonzero().flatten().tolist()
    r = rows[0]
    col = int((ref[r] != out[r]).nonzero()[0])
    return f"tokens differ in rows {rows}, first at row {r} col {col}"


def run_all(
    model_types: list[str] | None = None, model_impl: str = "auto", device: str = "cpu"
) -> list[report.ArchResult]:
    entries = causal_lm_entries()
    if model_types:
        entries = [e for e in entries if e[0] in model_types]
    return [run_arch(mt, cls, model_impl, device) for mt, cls in entries]


def markdown_table(
    results: list[report.ArchResult], block_size: int = BLOCK_SIZE, wide: bool = True
) -> str:
    """The coverage table: decoder-only text architectures first, then the ones not counted."""
    wide_text = (
        f", then {WIDE_COPIES} copies of them in one engine call (a "
        f"{WIDE_COPIES * sum(PROMPT_LENS)}-token step)"
        if wide
        else ""
    )
    c = report.summary(results)
    lines = [
        f"{c['served']} of {c['built']} decoder-only text architectures that build tiny are "
        f"served ({c['served_pct']}%), {c['fallback']} fall back with a named reason, "
        f"{c['failure']} fail. Tiny random fp32 models (hidden {HIDDEN}, 2 layers, vocab "
        f"{VOCAB}; the hybrid and recurrent families 2-4 layers of their own kinds, stock's "
        f"reference each prompt alone), left-padded prompts of {', '.join(map(str, PROMPT_LENS))} tokens, "
        f"{MAX_NEW_TOKENS} greedy tokens, KV blocks of {block_size}{wide_text}; transformers "
        f"{_tf_version()}.",
        "",
        *report.table_rows(results),
    ]
    return "\n".join(lines) + "\n"


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: list[str]) -> None:
    """``python -m tests.models.coverage_models [--write F] [--device D] [model_type ...]``: the
    table on stdout (and in F); each row also goes to stderr as it finishes, so a run cut report.short
    by a time limit still shows what it reached."""
    p = argparse.ArgumentParser(prog="python -m tests.models.coverage_models")
    p.add_argument("--write", default=None, help="also write the table to this file")
    p.add_argument("--device", default="cpu", help="where models, prompts and engines run")
    p.add_argument("--block-size", type=int, default=BLOCK_SIZE, help="KV block size")
    p.add_argument("--no-wide", action="store_true", help="skip the wide step")
    p.add_argument("model_types", nargs="*", help="default: every causal-LM entry")
    args = p.parse_args(argv)
    warnings.filterwarnings("ignore")
    entries = causal_lm_entries()
    if args.model_types:
        entries = [e for e in entries if e[0] in args.model_types]
    results = []
    for mt, cls in entries:
        r = run_arch(mt, cls, device=args.device, block_size=args.block_size, wide=not args.no_wide)
        results.append(r)
        report.print_row(r)
    report.print_table(markdown_table(results, args.block_size, not args.no_wide), args.write)


if __name__ == "__main__":
    main(sys.argv[1:])
