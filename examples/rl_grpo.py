"""TRL's GRPO on the paged engine: the rollouts of an RL loop, run with no code change.

    hf-paged run --report examples/rl_grpo.py            # rollouts on the paged engine
    hf-paged run --backend hf examples/rl_grpo.py        # the same script, stock generate

GRPOTrainer calls ``model.generate`` for every step's rollouts; under ``hf-paged run`` those
calls go to one engine per model. After each optimizer step (fused AdamW, the Trainer's
default) the engine copies the changed weights into its own tensors before the next rollout:
no engine rebuild, no KV cache re-allocation (the log says "changed weights refreshed").
The trainer runs at TRL's defaults except ``use_cpu`` and greedy generation: its default
``bf16=True`` wraps the forward in accelerate's bf16 autocast, and the engine runs under the same
autocast (docs/rl.md, "Mixed precision"). Generation is greedy here so that the paged and stock
runs can be compared token for token; sampled rollouts are just as current, but draw other
samples than stock (docs/rl.md says why).

A tiny random model and a character tokenizer are built locally (nothing is downloaded), so the
completions are gibberish. ``--lora`` trains a LoRA adapter instead of the whole model (TRL's
``peft_config``): the engine serves the adapter from its LoRA slots, the new factors loaded after
each step. ``--out FILE``
writes each step's completions as JSON lines.
"""

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from hf_paged.testing import build_char_tokenizer, save_tiny_model  # noqa: E402

PROMPTS = ["Hello, my name is", "The capital of France is", "def fib(n):", "1, 2, 3,",
           "Q: what is 2+2? A:", "Once upon a time", "The quick brown fox", "import torch"]  # fmt: skip


def tiny_policy(path: str) -> str:
    """A tiny random Qwen3 (hidden 64, 2 layers) and the char tokenizer saved to ``path``."""
    tok = build_char_tokenizer()
    save_tiny_model("qwen3", path, seed=0, vocab_size=len(tok), max_position_embeddings=1024)
    tok.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default=None, help="write each step's completions here")
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (needs peft)")
    args = parser.parse_args()

    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    workdir = tempfile.mkdtemp()
    path = tiny_policy(os.path.join(workdir, "policy"))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    rollouts = []

    def vowel_reward(completions, **kwargs):  # a deterministic reward: share of vowels
        rollouts.append(list(completions))
        return [sum(c in "aeiou" for c in text) / max(len(text), 1) for text in completions]

    extra, peft_config = {}, None
    if args.max_completion_length is not None:
        extra["max_completion_length"] = args.max_completion_length
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
    config = GRPOConfig(
        output_dir=os.path.join(workdir, "out"),
        use_cpu=True,
        max_steps=args.steps,
        generation_kwargs={"do_sample": False},  # greedy: comparable with stock, row for row
        report_to="none",
        **extra,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=vowel_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
        processing_class=tokenizer,
        peft_config=peft_config,
    )
    trainer.train()
    for step, texts in enumerate(rollouts):
        print(f"step {step}: {texts[0]!r}")
    if args.out:
        with open(args.out, "w") as f:
            for texts in rollouts:
                f.write(json.dumps(texts) + "\n")


if __name__ == "__main__":
    main()
