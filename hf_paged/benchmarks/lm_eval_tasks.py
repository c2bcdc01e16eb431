"""Local lm-eval tasks (YAML + JSONL) of the three request kinds, for runs of lm-eval's own CLI.

Each task is one ``<name>.yaml`` beside its ``<name>.jsonl`` in a folder passed to lm-eval as
``--include_path``:

* ``generate_until``: docs ``{"question", "answer"}``, greedy, ``until ["\\n\\n"]``,
  ``max_gen_toks`` new tokens at most, metric ``exact_match``;
* ``multiple_choice``: docs ``{"question", "choices", "label"}``, metric ``acc``;
* ``loglikelihood_rolling``: docs ``{"text"}``, lm-eval's default ``process_results`` for the
  kind (metric ``bits_per_byte``).

:func:`issue_docs` draws the documents of issue 29's runs (pseudo-words a byte-level BPE
tokenizer splits into about 1.5 tokens each: ``hf_paged.testing.tokenizer.random_words``).
Plain data: no lm-eval import.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
"""
BODY = {
    "generate_until": """doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "multiple_choice": """doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
    "loglikelihood_rolling": """doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
""",
}
KINDS = tuple(BODY)


def write_task(folder: Path, name: str, kind: str, docs: list[dict], max_gen_toks: int = 128):
    """``folder/name.yaml`` and ``folder/name.jsonl`` for lm-eval's ``--include_path``.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind not in BODY:
        raise ValueError(f"kind={kind!r} is not allowed: must be one of {list(KINDS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    yaml = HEAD.format(name=name, data=data, kind=kind)
    (folder / f"{name}.yaml").write_text(yaml + BODY[kind].format(max_gen_toks=max_gen_toks))


def issue_docs(kind: str, scale: float = 1.0, seed: int = 0) -> list[dict]:
    """Issue 29's documents of ``kind``; ``scale`` < 1 shrinks counts and lengths (smoke runs).

    * generate_until: 384 docs, a 260-word prefix every doc shares, then a question of 10-30
      words and ``"\\nA:"``;
    * multiple_choice: 1,000 docs, contexts of 150-250 words, 4 choices of 1-4 words;
    * loglikelihood_rolling: 100 docs of 800-2,400 words.
    """
    from hf_paged.testing.tokenizer import random_words

    rng = random.Random(seed)

    def n(x: int) -> int:
        return max(1, round(x * scale))

    def words(lo: int, hi: int) -> str:
        return random_words(rng, rng.randint(n(lo), n(hi)))

    if kind == "generate_until":
        prefix = random_words(rng, n(260))
        return [{"question": f"{prefix}\nQ{i}: {words(10, 30)}\nA:", "answer": words(1, 3)}
                for i in range(n(384))]  # fmt: skip
    if kind == "multiple_choice":
        return [{"question": words(150, 250) + "\nA:",
                 "choices": [" " + random_words(rng, rng.randint(1, 4)) for _ in range(4)],
                 "label": rng.randrange(4)} for _ in range(n(1000))]  # fmt: skip
    if kind == "loglikelihood_rolling":
        return [{"text": words(800, 2400)} for _ in range(n(100))]
    raise ValueError(f"kind={kind!r} is not allowed: must be one of {list(KINDS)}")
