"""Build the client suite's checkpoint in DIR: random weights (safetensors) and the character
tokenizer beside them (built with ``tokenizers``; one token per character, so a text's length
is its token count).

    cpu: Qwen3-shaped, hidden 64, 2 layers, vocab 99, max_position_embeddings 256 (fp32).
    gpu: Qwen3-0.6B's architecture, random bf16 weights, max_position_embeddings 40960.
"""

from __future__ import annotations

import argparse

from hf_paged.testing import build_char_tokenizer, save_tiny_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("cpu", "gpu"), required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    if args.size == "cpu":
        save_tiny_model("qwen3", args.out, vocab_size=99, max_position_embeddings=256)
        build_char_tokenizer().save_pretrained(args.out)
        return
    import torch

    from hf_paged.benchmarks.random_models import build_random_model

    model = build_random_model("qwen3-0.6b", device="cuda", dtype=torch.bfloat16)
    model.save_pretrained(args.out)
    build_char_tokenizer(vocab_size=model.config.vocab_size).save_pretrained(args.out)


if __name__ == "__main__":
    main()
