"""lm-eval on the paged engine equals stock lm-eval, sample by sample (issue 13, acceptance 1).

lm-eval's own CLI runs twice, as subprocesses, on local YAML + JSONL tasks over a tiny fp32
model with a character tokenizer: stock ``python -m lm_eval --model hf`` and
``hf-paged run -m lm_eval --model hf``. Tasks: two generate_until (stop strings of one and
several characters, left truncation, two gen_kwargs groups), a multiple-choice loglikelihood one
(one over-long request is left-truncated) and a loglikelihood_rolling one (several windows).
"""

from __future__ import annotations

import glob
import json
import math
import os
import random
import sys

import pytest

pytest.importorskip("lm_eval", reason="lm_eval is not installed (pip install hf-paged[lm_eval])")

from hf_paged.benchmarks.lm_eval_tasks import check_served, run_side_by_side, subprocess_env  # noqa: E402
from hf_paged.integration.lm_eval.scoring import score_window  # noqa: E402
from hf_paged.testing import save_demo_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
WORDS = ["the cat", "a dog", "red", "blue sky", "sea", "tea", "apple pie", "stars"]
GEN_YAML = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: {until}
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
"""
MC_YAML = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
"""
PPL_YAML = """task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
"""
TASKS = "tiny_gen,tiny_gen2,tiny_mc,tiny_ppl"


def _phrase(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def write_tasks(root: str) -> str:
    rng = random.Random(0)
    d = os.path.join(root, "tasks")
    os.makedirs(d)
    qs = [f"Q: {_phrase(rng, 1, 6)}\nA:" for _ in range(11)] + [f"Q: {_phrase(rng, 30, 30)}\nA:"]
    _write_jsonl(f"{d}/gen.jsonl", [{"question": q, "answer": rng.choice(WORDS)} for q in qs])
    mc = [f"Q: {_phrase(rng, 2, 20)}\nA:" for _ in range(9)] + [f"Q: {_phrase(rng, 40, 40)}\nA:"]
    _write_jsonl(
        f"{d}/mc.jsonl",
        [{"question": q, "choices": rng.sample(WORDS, 4), "label": rng.randrange(4)} for q in mc],
    )
    _write_jsonl(f"{d}/ppl.jsonl", [{"text": _phrase(rng, n, n)} for n in (5, 40, 90)])
    for name, until, n in (("tiny_gen", '["rr2", "3", "\\n"]', 24), ("tiny_gen2", '"CC"', 10)):
        with open(f"{d}/{name}.yaml", "w") as f:
            f.write(GEN_YAML.format(name=name, data=f"{d}/gen.jsonl", until=until, max_gen_toks=n))
    with open(f"{d}/tiny_mc.yaml", "w") as f:
        f.write(MC_YAML.format(data=f"{d}/mc.jsonl"))
    with open(f"{d}/tiny_ppl.yaml", "w") as f:
        f.write(PPL_YAML.format(data=f"{d}/ppl.jsonl"))
    return d


def lm_eval_cmd(model: str, tasks: str, out: str, paged: bool) -> list[str]:
    head = (
        [sys.executable, "-m", "hf_paged.entrypoints.cli", "run", "-m"]
        if paged
        else [sys.executable, "-m"]
    )
    return head + [
        "lm_eval", "--model", "hf", "--model_args", f"pretrained={model},dtype=float32",
        "--tasks", TASKS, "--include_path", tasks, "--device", "cpu", "--batch_size", "4",
        "--output_path", out, "--log_samples",
    ]  # fmt: skip


def samples(out: str, task: str) -> list[dict]:
    (path,) = glob.glob(f"{out}/*/samples_{task}_*.jsonl")
    with open(path) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def results(out: str) -> dict:
    (path,) = glob.glob(f"{out}/*/results_*.json")
    with open(path) as f:
        return json.load(f)["results"]


def close(a, b) -> bool:
    """Loglikelihoods within 1e-4; long sums (rolling windows) within stock's own fp32 sum
    rounding (1e-6 relative)."""
    return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-4)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lm_eval"))
    model = save_demo_model(os.path.join(root, "model"), seed=0)
    tasks = write_tasks(root)
    cmds = {name: lm_eval_cmd(model, tasks, os.path.join(root, name), paged)
            for name, paged in (("stock", False), ("paged", True))}  # fmt: skip
    runs = run_side_by_side(cmds, subprocess_env(ROOT), root, root, timeout=300)
    check_served(runs, tuple(f"Running {kind} requests (paged)"
                             for kind in ("generate_until", "loglikelihood")))  # fmt: skip
    return os.path.join(root, "stock"), os.path.join(root, "paged")


@pytest.mark.parametrize("task", ["tiny_gen", "tiny_gen2"])
def test_generate_until_equal(runs, task):
    stock, paged = (samples(out, task) for out in runs)
    assert len(stock) == len(paged) == 12
    for a, b in zip(stock, paged):
        assert a["arguments"] == b["arguments"]
        assert a["resps"] == b["resps"], (a["doc_id"], a["resps"], b["resps"])
    max_gen = 24 if task == "tiny_gen" else 10
    cut = [len(s["resps"][0][0]) < max_gen for s in stock]  # char tokenizer: 1 token per char
    assert any(cut) and not all(cut)  # stop strings / EOS cut some rows, not all


def test_loglikelihood_equal(runs):
    for task in ("tiny_mc", "tiny_ppl"):
        stock, paged = (samples(out, task) for out in runs)
        assert len(stock) == len(paged) > 0
        for a, b in zip(stock, paged):
            assert a["arguments"] == b["arguments"]
            for (ra,), (rb,) in zip(a["resps"], b["resps"], strict=True):
                if task == "tiny_mc":  # (loglikelihood, is_greedy)
                    assert close(ra[0], rb[0]) and ra[1] == rb[1], (a["doc_id"], ra, rb)
                else:
                    assert close(ra, rb), (a["doc_id"], ra, rb)


def test_metrics_equal(runs):
    stock, paged = (results(out) for out in runs)
    assert stock.keys() == paged.keys() == set(TASKS.split(","))
    for task, metrics in stock.items():
        for k, v in metrics.items():
            if isinstance(v, float) and "perplexity" not in k and "bits" not in k:
                assert v == paged[task][k], (task, k)
            elif isinstance(v, float):
                assert math.isclose(v, paged[task][k], rel_tol=1e-5), (task, k)


# ---- the adapter's pieces, in process --------------------------------------------------------


def test_score_window_truncates_like_stock():
    ctx, cont = list(range(10)), [20, 21, 22]
    assert score_window(ctx, cont, 100) == (ctx + cont, 10)
    # stock scores inp = (ctx + cont)[-(max_length + 1):][:-1]: the window keeps 9 tokens
    assert score_window(ctx, cont, 8) == ([4, 5, 6, 7, 8, 9, 20, 21, 22], 6)
    with pytest.raises(ValueError, match="continuation"):
        score_window(ctx, list(range(9)), 8)


def test_install_registers_model_and_uninstall_restores():
    import lm_eval.api.registry as registry

    from hf_paged.integration.lm_eval import install as adapter

    assert adapter.install_lm_eval()
    from lm_eval.models.huggingface import HFLM

    assert adapter.is_lm_eval_installed()
    assert HFLM.generate_until is adapter._generate_until
    cls = registry.get_model("hf-paged")
    assert issubclass(cls, HFLM) and cls.always_paged
    assert registry.get_model("hf") is HFLM  # lm-eval's own names still resolve
    original = adapter._originals["generate_until"]
    adapter.uninstall_lm_eval()
    assert HFLM.generate_until is original and not adapter.is_lm_eval_installed()


def test_until_matcher_is_lm_evals_criterion():
    """UntilMatcher stops at the step where lm-eval's MultiTokenEOSCriteria marks a row done,
    and never on a stop string that starts in the prompt (HF stop_strings would)."""
    import torch
    from lm_eval.models.utils_hf import MultiTokenEOSCriteria

    from hf_paged.integration.lm_eval.stop_text import UntilMatcher
    from hf_paged.testing import build_char_tokenizer

    tok = build_char_tokenizer()
    stops = ["\n\n", "ab", "c"]
    lookback = {s: len(tok.encode(s, add_special_tokens=False)) + 2 for s in stops}
    prompt = tok.encode("Q: x\n", add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(200):
        gen = tok.encode("".join(rng.choice("ab\nxc") for _ in range(6)), add_special_tokens=False)
        m = UntilMatcher(tok, lookback, len(prompt))
        crits = [MultiTokenEOSCriteria(s, tok, len(prompt), 1) for s in stops]
        for n in range(1, len(gen) + 1):
            ids = torch.tensor([prompt + gen[:n]])
            want = any([c(ids, None) for c in crits])  # every criterion sees every step
            assert m.matches(prompt + gen[:n]) == want, (gen[:n],)
            if want:
                break
    assert not UntilMatcher(tok, lookback, len(prompt)).matches(prompt + tok.encode("\n"))


@pytest.fixture
def hflm(tmp_path):
    """An in-process stock HFLM on the tiny model, with the adapter installed; the paged
    backend switch is left off and the engine released afterwards."""
    from lm_eval.models.huggingface import HFLM

    from hf_paged.integration import dispatch
    from hf_paged.integration.lm_eval import install as adapter

    adapter.install_lm_eval()
    lm = HFLM(pretrained=save_demo_model(str(tmp_path / "m")), device="cpu", dtype="float32",
              batch_size=4)  # fmt: skip
    yield lm, dispatch, adapter
    dispatch.set_default_backend(None)
    dispatch.release(lm.model)
    adapter.uninstall_lm_eval()


def _score_requests(n_ctx: int, n_cont: int):
    rng = random.Random(1)
    out = []
    for _ in range(n_ctx):
        ctx = [rng.randrange(4, 99) for _ in range(rng.randint(36, 44))]
        for _ in range(n_cont):
            out.append((None, ctx, [rng.randrange(4, 99) for _ in range(rng.randint(1, 6))]))
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlapped"])
def test_loglikelihood_shares_contexts(hflm, overlap):
    """Continuations of one context reuse its KV through the prefix cache (a small step budget:
    contexts are prefilled in chunks, over several steps) and still equal stock, also under
    overlapped stepping (what a GPU runs by default)."""
    import torch

    lm, dispatch, _ = hflm
    reqs = _score_requests(6, 3)
    ctx = reqs[0][1]  # and a 4th continuation that is the model's greedy one: is_greedy True
    greedy = lm.model.generate(torch.tensor([ctx]), max_new_tokens=3, do_sample=False)
    reqs.insert(3, (None, ctx, greedy[0, len(ctx) :].tolist()))
    dispatch.set_default_backend("hf")
    stock = lm._loglikelihood_tokens(reqs)
    assert stock[3][1] and not all(g for _, g in stock)
    dispatch.set_default_backend("paged")
    dispatch.configure(lm.model, max_num_batched_tokens=64, kv_block_size=8,
                       async_scheduling=overlap)  # fmt: skip
    ours = lm._loglikelihood_tokens(reqs)
    stats = dispatch.get_engine(lm.model).stats
    assert (stats["num_overlapped_steps"] > 0) == overlap
    # every continuation of a context after its first waits for that one to prefill it, then
    # takes every full block before its first scored row (row len(ctx) - 1) from the cache
    contexts = [tuple(c) for _, c, _ in reqs]
    want = sum((contexts.count(c) - 1) * ((len(c) - 1) // 8 * 8) for c in set(contexts))
    assert stats["prefix_cache_hit_tokens"] == want
    for (a, ga), (b, gb) in zip(stock, ours, strict=True):
        assert close(a, b) and ga == gb


def test_fallback_is_named(hflm):
    """What the engine does not reproduce (here autocast) runs stock, with a named warning."""
    import torch

    from hf_paged import PagedFallbackWarning

    lm, dispatch, adapter = hflm
    reqs = _score_requests(2, 2)
    lm.mixed_precision_dtype = torch.bfloat16
    dispatch.set_default_backend("hf")
    stock = lm._loglikelihood_tokens(reqs)
    dispatch.set_default_backend("paged")
    from hf_paged.integration.fallback import reset_fallback_warnings

    reset_fallback_warnings()
    with pytest.warns(PagedFallbackWarning, match=r"autocast"):
        assert lm._loglikelihood_tokens(reqs) == stock


@pytest.mark.parametrize("until", [[""], ["", "c"]], ids=["empty", "empty_and_c"])
def test_empty_stop_string_ends_after_one_token_as_stock(hflm, until):
    """An empty ``until`` string (a task's, or an EOS that decodes to '') is in every text:
    stock's MultiTokenEOSCriteria ends each row after its first token; so must the engine."""
    from lm_eval.api.instance import Instance

    lm, dispatch, _ = hflm
    reqs = [Instance("generate_until", {}, (ctx, {"until": list(until), "max_gen_toks": 6}), 0)
            for ctx in ("the cat", "a dog sat", "red")]  # fmt: skip
    dispatch.set_default_backend("hf")
    stock = lm.generate_until(reqs, disable_tqdm=True)
    dispatch.set_default_backend("paged")
    assert lm.generate_until(reqs, disable_tqdm=True) == stock
    assert dispatch.owner(lm.model).engine is not None  # the engine served them
