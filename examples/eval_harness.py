"""An evaluation-harness ``generate_until`` loop (lm-evaluation-harness's shape) on the engine.

The harness code is unchanged except for one keyword, ``backend="paged"``: left-padded batches,
``max_length`` = context + ``max_gen_toks``, a custom ``StoppingCriteria`` that decodes the
continuation and stops a row once its text contains a stop string, and ``pad_token_id``. Because
the criterion watches every step, the engine hands each step's logits back and HF's own loop body
picks the tokens: outputs equal stock ``generate``. A tiny random model is built locally.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import hf_paged  # noqa: E402, F401  (installs the generate dispatcher)
from hf_paged.testing import build_char_tokenizer, save_tiny_model  # noqa: E402

MAX_GEN_TOKS = 16


class MultiTokenEOSCriteria(StoppingCriteria):
    """lm-eval's stop criterion: done once the decoded continuation contains ``sequence``."""

    def __init__(self, sequence, tokenizer, initial_decoder_input_length, batch_size):
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch_size
        self.sequence = sequence
        self.sequence_id_len = len(tokenizer.encode(sequence, add_special_tokens=False)) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        lookback = input_ids[:, self.initial_decoder_input_length :][:, -self.sequence_id_len :]
        texts = self.tokenizer.batch_decode(lookback)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in texts[i]
        return False not in self.done_tracker


def generate_until(model, tokenizer, contexts, until, backend):
    """One harness batch: left-padded contexts -> continuations cut at the first stop string."""
    enc = tokenizer(contexts, return_tensors="pt", padding="longest")
    ids, mask = enc["input_ids"], enc["attention_mask"]
    criteria = StoppingCriteriaList(
        [MultiTokenEOSCriteria(s, tokenizer, ids.shape[1], ids.shape[0]) for s in until]
    )
    kwargs = {} if backend is None else {"backend": backend}
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_length=ids.shape[1] + MAX_GEN_TOKS,
        stopping_criteria=criteria,
        pad_token_id=tokenizer.pad_token_id,
        use_cache=True,
        do_sample=False,
        **kwargs,
    )
    results = []
    for row in out[:, ids.shape[1] :]:
        text = tokenizer.decode(row, skip_special_tokens=True)
        for stop in until:
            text = text.split(stop)[0]
        results.append(text)
    return results


def main() -> None:
    path = os.path.join(tempfile.mkdtemp(), "tiny-llama")
    save_tiny_model("llama", path, seed=3)
    tokenizer = build_char_tokenizer()
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path).eval()

    contexts = ["Q: What is 2+2?\nA:", "Translate 'chat' to English:", "def add(a, b):", "x"]
    until = ["\n\n", "Q:", "G"]
    paged = generate_until(model, tokenizer, contexts, until, backend="paged")
    stock = generate_until(model, tokenizer, contexts, until, backend=None)
    for ctx, text in zip(contexts, paged):
        print(f"{ctx!r} -> {text!r}")
    print("same as stock:", paged == stock)


if __name__ == "__main__":
    main()
