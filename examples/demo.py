"""`make demo`: build a tiny random model locally and generate text through hf_paged.

The weights are random, so the text is gibberish; what the demo shows is the whole path:
safetensors checkpoint + tokenizer on disk -> ``pipeline("text-generation", backend="paged")``
-> the paged engine -> text, and the same through the ``LLM`` API.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import transformers  # noqa: E402

from hf_paged import LLM, SamplingParams  # noqa: E402  (importing hf_paged installs the switch)
from hf_paged.testing import save_demo_model  # noqa: E402


def main() -> None:
    path = save_demo_model(os.path.join(tempfile.mkdtemp(), "tiny-qwen3"))
    prompts = ["Hello, my name is", "The capital of France is", "def fib(n):"]
    engine = {"num_kv_blocks": 64, "kv_block_size": 16}

    pipe = transformers.pipeline(
        "text-generation", model=path, backend="paged", paged_config=engine
    )
    for p, out in zip(prompts, pipe(prompts, max_new_tokens=24, do_sample=False)):
        print(f"pipeline  {p!r} -> {out[0]['generated_text'][len(p) :]!r}")

    with LLM(path, **engine) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    for p, o in zip(prompts, outs):
        print(f"LLM       {p!r} -> {o.text!r} ({len(o.token_ids)} tokens, {o.finish_reason})")


if __name__ == "__main__":
    main()
