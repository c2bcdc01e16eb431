"""Local lm-eval tasks (YAML + JSONL) of the three request kinds, for runs of lm-eval's own CLI.

Each task is one ``<name>.yaml`` beside its ``<name>.jsonl`` in a folder passed to lm-eval as
``--include_path``:

* ``generate_until``: docs ``{"question", "answer"}``, greedy, ``until ["\\n\\n"]``,
  ``max_gen_toks`` new tokens at most, metric ``exact_match``;
* ``multiple_choice``: docs ``{"question", "choices", "label"}``, metric ``acc``;
* ``loglikelihood_rolling``: docs ``{"text"}``, lm-eval's default ``process_results`` for the
  kind (metric ``bits_per_byte``).

Plain data: no lm-eval import. The documents of issue 29's runs: ``evaluation/run_lm_eval_cli.py``.
"""

from __future__ import annotations

import json
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
