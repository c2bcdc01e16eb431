"""Batch generation over a ``datasets.Dataset`` with ``Dataset.map`` on the paged engine.

    from hf_paged.entrypoints.datasets_map import paged_generate_map

    fn = paged_generate_map("path/to/ckpt", column="prompt", output_column="generated",
                            batch_size=256, max_new_tokens=32, do_sample=False)
    ds = ds.map(fn, **fn.map_kwargs)   # batched=True, batch_size=256: one engine run per batch

Every row gets what ``model.generate`` gives it alone (compared with stock below). A tiny random
model is built locally, so the text is gibberish.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_paged.entrypoints.datasets_map import paged_generate_map  # noqa: E402
from hf_paged.testing import save_demo_model  # noqa: E402


def main() -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = save_demo_model(os.path.join(tempfile.mkdtemp(), "tiny-qwen3"))
    prompts = ["Hello, my name is", "The capital of France is", "def fib(n):", "1, 2, 3,", "Q:"]
    ds = Dataset.from_dict({"prompt": prompts})

    fn = paged_generate_map(
        path, column="prompt", output_column="generated", batch_size=4,
        max_new_tokens=12, do_sample=False, paged_config={"num_kv_blocks": 64},
    )  # fmt: skip
    out = ds.map(fn, **fn.map_kwargs)
    fn.close()
    for row in out:
        print(f"{row['prompt']!r} -> {row['generated']!r}")

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    stock = []
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=12, do_sample=False)
        stock.append(
            tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        )
    print("same as stock:", list(out["generated"]) == stock)


if __name__ == "__main__":
    main()
