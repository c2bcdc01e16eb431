"""Shared by the pipeline / datasets / quantized tests: prompts, greedy settings, a small
pipeline engine, and what stock ``generate`` gives one prompt (their fixtures: conftest.py)."""

from __future__ import annotations

import torch

# small enough to build in milliseconds; 4-token blocks and 16-token steps exercise paging and
# chunked prefill even on these short prompts
SMALL_ENGINE = dict(
    device="cpu", num_kv_blocks=96, kv_block_size=4, max_num_seqs=4, max_num_batched_tokens=16
)
GREEDY = dict(max_new_tokens=8, do_sample=False)
PROMPTS = ["Hello, my name is", "ab", "The capital of France is", "def fib(n):", "x y z"]
CHAT = [{"role": "user", "content": "Tell me a joke."}]


def stock_new_text(model, tokenizer, prompt, **generate_kwargs) -> str:
    """What stock ``generate`` gives ``prompt`` alone: its new tokens, decoded."""
    if isinstance(prompt, str):
        enc = tokenizer(prompt, return_tensors="pt")
    else:
        enc = tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, return_dict=True, return_tensors="pt"
        )
    with torch.no_grad():
        out = model.generate(**enc, **generate_kwargs)
    return tokenizer.decode(out[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
