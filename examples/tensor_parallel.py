"""Tensor parallelism on CPU: the engine split over 2 processes (gloo), same outputs as 1.

    llm = LLM("path/to/ckpt", tensor_parallel_size=2)
    model = AutoPagedModelForCausalLM.from_pretrained("path/to/ckpt", tensor_parallel_size=2)
    pipe = pipeline("text-generation", model=model, tokenizer=tok)

Each rank loads only its shard of the checkpoint (the HF model is never built). On GPUs rank r
of an engine on cuda:N uses cuda:N+r. A tiny random model is built locally.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_paged import LLM, SamplingParams  # noqa: E402
from hf_paged.integration.auto import AutoPagedModelForCausalLM  # noqa: E402
from hf_paged.testing import save_demo_model  # noqa: E402

ENGINE = dict(device="cpu", num_kv_blocks=64, kv_block_size=16)


def main() -> None:
    from transformers import AutoTokenizer, pipeline

    path = save_demo_model(os.path.join(tempfile.mkdtemp(), "tiny-qwen3"))
    prompts = ["Hello, my name is", "The capital of France is", "def fib(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=16)

    with LLM(path, **ENGINE) as llm:
        single = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        split = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
        for p, text in zip(prompts, split):
            print(f"tp=2 {p!r} -> {text!r}")
    print("same as tp=1:", split == single)

    with AutoPagedModelForCausalLM.from_pretrained(path, tensor_parallel_size=2, **ENGINE) as model:
        tokenizer = AutoTokenizer.from_pretrained(path)
        pipe = pipeline("text-generation", model=model, tokenizer=tokenizer, device="cpu")
        out = pipe(prompts, max_new_tokens=16, do_sample=False, return_full_text=False)
        texts = [o[0]["generated_text"] for o in out]
        print("pipeline tp=2:", texts)
        print("pipeline same as tp=1:", texts == single)


if __name__ == "__main__":
    main()
