"""Drop-in: a transformers text-generation pipeline on the paged engine with one keyword.

    import hf_paged  # installs the generate and pipeline dispatchers (they do nothing unasked)
    from transformers import pipeline

    pipe = pipeline("text-generation", model="path/to/ckpt", backend="paged")  # engine loads it
    pipe = pipeline("text-generation", model=loaded_model, tokenizer=tok, backend="paged")

Strings, lists with ``batch_size``, chats, ``return_full_text`` and datasets (``KeyDataset``) work
as with stock pipelines, and greedy outputs are the same. A tiny random model is built locally,
so the text is gibberish.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import hf_paged  # noqa: E402, F401  (installs the dispatchers)
from hf_paged.testing import save_demo_model  # noqa: E402


def main() -> None:
    from datasets import Dataset
    from transformers import pipeline
    from transformers.pipelines.pt_utils import KeyDataset

    path = save_demo_model(os.path.join(tempfile.mkdtemp(), "tiny-qwen3"))
    greedy = dict(max_new_tokens=12, do_sample=False)
    prompts = ["Hello, my name is", "The capital of France is", "def fib(n):"]
    chat = [{"role": "user", "content": "Tell me a joke."}]

    # a checkpoint path: the engine loads the weights, the HF model is never built
    pipe = pipeline(
        "text-generation", model=path, backend="paged", device="cpu",
        paged_config={"num_kv_blocks": 64, "max_num_seqs": 8},
    )  # fmt: skip
    print("model:", pipe.model)
    paged = {
        "string": pipe(prompts[0], **greedy),
        "batch": pipe(prompts, batch_size=2, return_full_text=False, **greedy),
        "chat": pipe(chat, **greedy),
    }
    dataset = Dataset.from_dict({"text": prompts})
    paged["dataset"] = list(pipe(KeyDataset(dataset, "text"), batch_size=2, **greedy))
    for name, out in paged.items():
        print(f"{name}: {out}")

    stock_pipe = pipeline("text-generation", model=path, device="cpu")
    stock = {
        "string": stock_pipe(prompts[0], **greedy),
        "batch": stock_pipe(prompts, batch_size=2, return_full_text=False, **greedy),
        "chat": stock_pipe(chat, **greedy),
        "dataset": list(stock_pipe(KeyDataset(dataset, "text"), batch_size=2, **greedy)),
    }
    # a loaded model: its generate calls go to the dispatcher's engine
    loaded = pipeline(
        "text-generation", model=stock_pipe.model, tokenizer=stock_pipe.tokenizer,
        backend="paged", device="cpu",
    )  # fmt: skip
    same_loaded = loaded(prompts, batch_size=2, **greedy) == stock_pipe(prompts, **greedy)
    print("same as stock:", paged == stock and same_loaded)


if __name__ == "__main__":
    main()
