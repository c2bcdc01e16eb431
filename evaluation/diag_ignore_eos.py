"""Why `LLM` can disagree with stock on the real model: `ignore_eos` is not `min_new_tokens`.

Stock runs the 32 chat prompts (``hf_paged/testing/chat_prompts.py``) as one left-padded batch
with ``min_new_tokens=max_new_tokens`` (EOS masked until then, HF's ``MinNewTokensLength``
processor). `LLM` (prefix caching on) runs them twice: with ``min_tokens`` (the same masking) and
with ``ignore_eos=True`` (vLLM's meaning: EOS may be chosen and generation goes on past it). For
each row the script records whether it equals stock and, where it does not, the first differing
position with both tokens. With ``min_tokens`` every row is equal; with ``ignore_eos`` a row
differs exactly where the model chose EOS, the token stock's processor had masked.

    PYTHONPATH=. OMP_NUM_THREADS=1 python evaluation/diag_ignore_eos.py [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="models/smollm2-135m-instruct")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--out", default=str(RESULTS_DIR / "diag_ignore_eos.json"))
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_paged import LLM, SamplingParams
    from hf_paged.testing.chat_prompts import chat_ids

    new = args.new_tokens
    tok = AutoTokenizer.from_pretrained(args.model)
    tok.padding_side = "left"
    ids = chat_ids(tok)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    batch = tok.pad({"input_ids": ids}, return_tensors="pt")
    out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    stock = out[:, batch["input_ids"].shape[1] :].tolist()
    log("stock done")
    record = {"benchmark": "diag_ignore_eos", "env": environment(), "new_tokens": new,
              "eos_token_id": tok.eos_token_id, "rows": len(ids), "variants": {}}  # fmt: skip
    for variant, extra in (("min_tokens", {"min_tokens": new}), ("ignore_eos", {"ignore_eos": True})):
        with LLM(args.model, dtype="float32", enable_prefix_caching=True) as llm:
            sp = SamplingParams(max_tokens=new, temperature=0.0, **extra)
            outs = llm.generate([{"prompt_token_ids": p} for p in ids], sp, use_tqdm=False)
        ours = [list(o.outputs[0].token_ids) for o in outs]
        diffs = {}
        for i, (a, b) in enumerate(zip(ours, stock)):
            k = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
            if k is not None:
                diffs[i] = {"position": k, "ours": a[k], "stock": b[k]}
        at_eos = sum(d["ours"] == tok.eos_token_id for d in diffs.values())
        record["variants"][variant] = {"equal_rows": len(ids) - len(diffs),
                                       "first_differences": diffs,
                                       "differences_where_ours_chose_eos": at_eos}  # fmt: skip
        log(f"{variant}: {len(ids) - len(diffs)}/{len(ids)} rows equal stock; "
            f"{at_eos}/{len(diffs)} differences start where LLM chose EOS")  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=1))
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
