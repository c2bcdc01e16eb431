"""lm-eval with ``peft=`` in ``--model_args`` through ``hf-paged run`` equals stock lm-eval: the
PEFT model's LoRA is served from the engine's slots (its active adapter on every request), for
generate_until and loglikelihood requests, sample by sample."""

from __future__ import annotations

import glob
import json
import math
import os
import random
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")
pytest.importorskip("peft")

from hf_paged.benchmarks.lm_eval_tasks import check_served, run_side_by_side, subprocess_env  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TASKS = "tiny_gen,tiny_mc"
_DATA = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
GEN_YAML = ("task: tiny_gen\n" + _DATA + "output_type: generate_until\n"
            'doc_to_text: "{{{{question}}}}"\ndoc_to_target: "{{{{answer}}}}"\n'
            'generation_kwargs:\n  until: ["3", "\\n"]\n  max_gen_toks: 16\n  do_sample: false\n'
            "metric_list:\n  - metric: exact_match\n")  # fmt: skip
MC_YAML = ("task: tiny_mc\n" + _DATA + "output_type: multiple_choice\n"
           'doc_to_text: "{{{{question}}}}"\ndoc_to_choice: "{{{{choices}}}}"\n'
           'doc_to_target: "{{{{label}}}}"\nmetric_list:\n  - metric: acc\n')  # fmt: skip
WORDS = ["the cat", "a dog", "red", "blue sky", "sea", "tea", "apple pie", "stars"]


def write_tasks(root: str) -> str:
    rng = random.Random(0)
    d = os.path.join(root, "tasks")
    os.makedirs(d)
    phrase = lambda: " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 8)))  # noqa: E731
    rows = {"gen": [{"question": f"Q: {phrase()}\nA:", "answer": rng.choice(WORDS)}
                    for _ in range(12)],
            "mc": [{"question": f"Q: {phrase()}\nA:", "choices": rng.sample(WORDS, 4),
                    "label": rng.randrange(4)} for _ in range(8)]}  # fmt: skip
    for kind, yaml in (("gen", GEN_YAML), ("mc", MC_YAML)):
        with open(f"{d}/{kind}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows[kind])
        with open(f"{d}/tiny_{kind}.yaml", "w") as f:
            f.write(yaml.format(data=f"{d}/{kind}.jsonl"))
    return d


def lm_eval_cmd(model: str, adapter: str, tasks: str, out: str, paged: bool) -> list[str]:
    head = [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", "-m"] if paged else [
        sys.executable, "-m"]  # fmt: skip
    return head + [
        "lm_eval", "--model", "hf", "--model_args",
        f"pretrained={model},dtype=float32,peft={adapter}", "--tasks", TASKS,
        "--include_path", tasks, "--device", "cpu", "--batch_size", "4", "--output_path", out,
        "--log_samples",
    ]  # fmt: skip


def samples(out: str, task: str) -> list[dict]:
    (path,) = glob.glob(f"{out}/*/samples_{task}_*.jsonl")
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def close(a, b) -> bool:
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hf_paged.testing import save_demo_model, save_random_lora

    root = str(tmp_path_factory.mktemp("lm_eval_peft"))
    model = save_demo_model(os.path.join(root, "model"), seed=0)
    adapter = save_random_lora(model, os.path.join(root, "adapter"), 3, r=4, lora_alpha=8,
                               target_modules=["q_proj", "v_proj", "down_proj"])  # fmt: skip
    tasks = write_tasks(root)
    cmds = {name: lm_eval_cmd(model, adapter, tasks, os.path.join(root, name), paged)
            for name, paged in (("stock", False), ("paged", True))}  # fmt: skip
    runs = run_side_by_side(cmds, subprocess_env(ROOT), root, root, timeout=400)
    check_served(runs, tuple(f"Running {kind} requests (paged)"
                             for kind in ("generate_until", "loglikelihood")))  # fmt: skip
    return os.path.join(root, "stock"), os.path.join(root, "paged")


def test_generate_until_with_peft_equal(runs):
    stock, paged = (samples(out, "tiny_gen") for out in runs)
    assert len(stock) == len(paged) == 12
    for a, b in zip(stock, paged):
        assert a["resps"] == b["resps"], (a["doc_id"], a["resps"], b["resps"])


def test_loglikelihood_with_peft_equal(runs):
    stock, paged = (samples(out, "tiny_mc") for out in runs)
    assert len(stock) == len(paged) > 0
    for a, b in zip(stock, paged):
        for (ra,), (rb,) in zip(a["resps"], b["resps"], strict=True):
            assert close(ra[0], rb[0]) and ra[1] == rb[1], (a["doc_id"], ra, rb)
