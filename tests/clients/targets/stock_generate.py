"""Stock reference for the script, datasets, Ray and torchrun clients: HF ``generate`` on each
prompt alone (no padding), greedy. Writes ``[{"ids": new token ids, "text": decoded}]``."""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="a JSON list of texts")
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model = model.to(args.device).eval()
    rows = []
    for text in prompts:
        ids = tok(text, return_tensors="pt").input_ids.to(args.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=args.new_tokens)  # fmt: skip
        new = out[0, ids.shape[1] :].tolist()
        rows.append({"ids": new, "text": tok.decode(new, skip_special_tokens=True)})
    with open(args.out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
