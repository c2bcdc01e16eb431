"""How batch-variant stock itself is under accelerate's bf16 autocast, and where paged stands.

    PYTHONPATH=. .venv/bin/python evaluation/diag_autocast_batch_variance.py [--new-tokens 32]
        [--families llama qwen3 gemma2] [--out FILE]

For each tiny model (hidden 64, 2 layers; gemma2 through the generic path) and 16 prompts of 1 to
64 tokens, greedy: stock on each prompt alone (the oracle), stock on all of them in one
left-padded batch, and ``generate(backend="paged")`` on the same batch (whole prompts prefilled,
every sequence in one step), in float32 and under ``torch.autocast("cpu", bf16)`` as accelerate
wraps the forward. Counts the rows (and tokens) that differ from the prompt alone. Under bf16,
stock's own batched rows leave their alone tokens now and then: that bounds what "equal to
stock" can mean under autocast. Writes ``evaluation/results/autocast_batch_variance_<UTC>.json``
(or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import types
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LENGTHS = [1, 2, 3, 5, 8, 11, 16, 17, 20, 24, 31, 33, 40, 47, 55, 64]
ENGINE = dict(num_kv_blocks=512, kv_block_size=4, max_num_seqs=16, max_num_batched_tokens=1024,
              seed=0)  # fmt: skip


def _model(family: str):
    from hf_paged.testing import build_hf_model
    from hf_paged.testing.any_model import build_tiny

    return build_tiny(family)[1] if family == "gemma2" else build_hf_model(family, seed=0)


def _autocast(model) -> None:
    """What ``Accelerator.prepare_model`` does with mixed_precision="bf16" on the CPU."""
    from accelerate.utils import convert_outputs_to_fp32

    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    model.forward = types.MethodType(autocast(model.forward.__func__), model)
    model.forward = types.MethodType(convert_outputs_to_fp32(model.forward.__func__), model)


def _differ(rows, oracle) -> dict:
    return {
        "rows": sum(r != o for r, o in zip(rows, oracle)),
        "tokens": sum(a != b for r, o in zip(rows, oracle) for a, b in zip(r, o)),
    }


def measure(family: str, new_tokens: int) -> dict:
    from hf_paged.integration import dispatch
    from hf_paged.testing.parity import hf_greedy
    from hf_paged.testing.prompts import left_pad, make_prompts

    out = {}
    for precision in ("fp32", "bf16_autocast"):
        model = _model(family)
        if precision != "fp32":
            _autocast(model)
        prompts = make_prompts(LENGTHS, seed=0, vocab=model.config.vocab_size)
        ids, mask = left_pad(prompts)
        kw = dict(attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)  # fmt: skip
        alone = hf_greedy(model, prompts, new_tokens)
        stock = model.generate(ids, **kw, backend="hf")[:, ids.shape[1] :].tolist()
        dispatch.configure(model, **ENGINE)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            paged = model.generate(ids, **kw, backend="paged")[:, ids.shape[1] :].tolist()
        fallbacks = [str(w.message) for w in caught if "Fallback" in w.category.__name__]
        dispatch.release(model)
        out[precision] = {
            "stock_batched_vs_alone": _differ(stock, alone),
            "paged_vs_stock_alone": _differ(paged, alone),
            "paged_fallbacks": fallbacks,
        }
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--families", nargs="+", default=["llama", "qwen3", "gemma2"])
    p.add_argument("--out")
    args = p.parse_args()
    torch.set_num_threads(1)
    from hf_paged.integration import dispatch

    dispatch.install()
    results = {f: measure(f, args.new_tokens) for f in args.families}
    for family, r in results.items():
        for precision, m in r.items():
            print(f"{family:<7} {precision:<14} stock batched vs alone: "
                  f"{m['stock_batched_vs_alone']['rows']}/{len(LENGTHS)} rows; paged vs stock "
                  f"alone: {m['paged_vs_stock_alone']['rows']}/{len(LENGTHS)} rows; "
                  f"fallbacks {len(m['paged_fallbacks'])}")  # fmt: skip
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = Path(
        args.out or ROOT / "evaluation" / "results" / f"autocast_batch_variance_{stamp}.json"
    )
    path.write_text(json.dumps({
        "benchmark": "autocast_batch_variance", "git_sha": sha, "machine": os.uname().nodename,
        "torch": torch.__version__, "prompts": len(LENGTHS), "prompt_lengths": LENGTHS,
        "new_tokens": args.new_tokens, "results": results,
    }, indent=2) + "\n")  # fmt: skip
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
