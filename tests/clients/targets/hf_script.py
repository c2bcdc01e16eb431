"""An unmodified HF script: left-padded batches through ``model.generate``, greedy. The suite
runs it as ``python hf_script.py ...`` (stock) and ``hf-paged run hf_script.py ...`` (paged)."""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

p = argparse.ArgumentParser()
p.add_argument("--model", required=True)
p.add_argument("--prompts", required=True)
p.add_argument("--new-tokens", type=int, required=True)
p.add_argument("--device", required=True)
p.add_argument("--dtype", required=True)
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--out", required=True)
args = p.parse_args()

with open(args.prompts) as f:
    prompts = json.load(f)
tokenizer = AutoTokenizer.from_pretrained(args.model)
tokenizer.padding_side = "left"
model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
model = model.to(args.device).eval()
texts = []
for i in range(0, len(prompts), args.batch_size):
    batch = tokenizer(prompts[i : i + args.batch_size], return_tensors="pt", padding=True)
    batch = batch.to(args.device)
    out = model.generate(**batch, max_new_tokens=args.new_tokens, do_sample=False)
    texts += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
with open(args.out, "w") as f:
    json.dump(texts, f)
