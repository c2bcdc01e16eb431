"""Tensor parallelism on CPU: the engine split over 2 processes (gloo), same outputs as stock.

    llm = LLM("path/to/ckpt", tensor_parallel_size=2)
    model = AutoPagedModelForCausalLM.from_pretrained("path/to/ckpt", tensor_parallel_size=2)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)

Each rank loads only its shard of the checkpoint (the HF model is never built). On GPUs rank r
of an engine on cuda:N uses cuda:N+r. Here the pipeline shares the LLM's engine
(``AutoPagedModelForCausalLM.from_engine``), so only one worker process starts. A tiny random
model is built locally.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.integration.auto import AutoPagedModelForCausalLM  # noqa: E402
from hf_paged.testing import save_demo_model  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):"]
MAX_TOKENS = 16


def stock_texts(path: str) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = []
    for prompt in PROMPTS:
        enc = tokenizer(prompt, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=MAX_TOKENS, do_sample=False)
        texts.append(
            tokenizer.decode(ids[0, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        )
    return texts


def main() -> None:
    from transformers import pipeline

    path = save_demo_model(os.path.join(tempfile.mkdtemp(), "tiny-qwen3"))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(path, tensor_parallel_size=2, device="cpu", num_kv_blocks=64) as llm:
        split = [o.text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        for p, text in zip(PROMPTS, split):
            print(f"tp=2 {p!r} -> {text!r}")

        model = AutoPagedModelForCausalLM.from_engine(llm.engine)
        pipe = pipeline("text-generation", model=model, tokenizer=llm.tokenizer, device="cpu")
        out = pipe(PROMPTS, max_new_tokens=MAX_TOKENS, do_sample=False, return_full_text=False)
        piped = [o[0]["generated_text"] for o in out]
        print("pipeline tp=2:", piped)

    stock = stock_texts(path)
    print("same as stock:", split == stock and piped == stock)


if __name__ == "__main__":
    main()
