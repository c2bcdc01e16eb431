"""lm-eval's loglikelihood tokenization: stock's per-request ``tok_encode`` against the paged
patch's batches (``hf_paged.integration.lm_eval.tokenize.encode_many``), on CPU.

Workload: ``--contexts`` contexts of about ``--words`` pseudo-words (``random_words``), each with
``--conts`` continuations of 1-3 words (default 1,000 x 4 = 4,000 requests, as a
multiple-choice task); a byte-level BPE tokenizer of ``--merges`` learned tokens
(``build_bpe_tokenizer``, in the shape of the Qwen / Llama-3 ones). ``TOKENIZERS_PARALLELISM``
is ``false``, as lm-eval's CLI sets it.

Timed: HFLM.loglikelihood up to its ``_loglikelihood_tokens`` call (replaced by a recorder), so
only the tokenization: stock's method, and the patched one run paged, with the thread pool
sized for this machine and with one thread (what the threads add). Each is the best of
``--repeats``, the three interleaved; the token requests of every run are checked equal to
stock's. Results:
evaluation/results/lm_eval_tokenize_<UTC>.json.

  OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python evaluation/bench_lm_eval_tokenize.py
"""

from __future__ import annotations

import argparse
import os
import random
import time
from types import SimpleNamespace

os.environ["TOKENIZERS_PARALLELISM"] = "false"  # before tokenizers loads, as lm-eval's CLI

from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.integration.lm_eval import install as adapter  # noqa: E402
from hf_paged.integration.lm_eval import tokenize  # noqa: E402
from hf_paged.testing.tokenizer import build_bpe_tokenizer, random_words  # noqa: E402


def requests(contexts: int, conts: int, words: int, seed: int = 0) -> list[SimpleNamespace]:
    rng = random.Random(seed)
    out = []
    for _ in range(contexts):
        ctx = f"Question: {random_words(rng, rng.randint(words * 3 // 4, words * 5 // 4))}\nAnswer:"
        out.extend(SimpleNamespace(args=(ctx, f" {random_words(rng, rng.randint(1, 3))}"))
                   for _ in range(conts))  # fmt: skip
    return out


def tokenizing_hflm(tokenizer):
    """An HFLM with only what its tokenization reads (no model), its ``_loglikelihood_tokens``
    recording the token requests instead of scoring them."""
    from lm_eval.models.huggingface import HFLM

    lm = HFLM.__new__(HFLM)
    lm.tokenizer, lm.add_bos_token, lm.custom_prefix_token_id = tokenizer, None, None
    lm.backend, lm.enable_thinking, lm.always_paged = "causal", False, True
    lm.recorded = None

    def record(new_reqs, disable_tqdm=False):
        lm.recorded = new_reqs
        return [(0.0, False)] * len(new_reqs)

    lm._loglikelihood_tokens = record
    return lm


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def one_thread(fn):
    """``fn`` with ``encode_many`` on one thread."""
    threads, tokenize.num_threads = tokenize.num_threads, lambda: 1
    try:
        return fn()
    finally:
        tokenize.num_threads = threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--contexts", type=int, default=1000)
    p.add_argument("--conts", type=int, default=4)
    p.add_argument("--words", type=int, default=200)
    p.add_argument("--merges", type=int, default=8000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    tok = build_bpe_tokenizer(merges=args.merges)
    adapter.install_lm_eval()
    lm = tokenizing_hflm(tok)
    reqs = requests(args.contexts, args.conts, args.words)
    stock_fn = adapter._originals["loglikelihood"]  # lm-eval's HFLM.loglikelihood

    stock_fn(lm, reqs, disable_tqdm=True)
    want = lm.recorded
    n_tokens = sum(len(c) + len(x) for _, c, x in want)
    log(f"{len(reqs)} requests, {n_tokens} tokens; {tokenize.num_threads()} threads")
    # the three interleaved, best of each: a load that comes and goes hits all of them alike
    runs = {
        "stock": lambda: stock_fn(lm, reqs, disable_tqdm=True),
        "ours": lambda: lm.loglikelihood(reqs, disable_tqdm=True),
        "one": lambda: one_thread(lambda: lm.loglikelihood(reqs, disable_tqdm=True)),
    }
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(args.repeats):
        for name, fn in runs.items():
            lm.recorded = None
            best[name] = min(best[name], timed(fn))
            assert lm.recorded == want, f"{name}: the token requests differ from stock's"
    t_stock, t_ours, t_one = best["stock"], best["ours"], best["one"]
    log(f"stock {t_stock:.3f}s, ours {t_ours:.3f}s ({t_stock / t_ours:.2f}x), "
        f"ours on 1 thread {t_one:.3f}s ({t_stock / t_one:.2f}x); requests equal")  # fmt: skip

    result = {
        "env": environment(),
        "args": vars(args),
        "cpus": os.cpu_count(),
        "threads": tokenize.num_threads(),
        "requests": len(reqs),
        "tokens": n_tokens,
        "stock_s": t_stock,
        "ours_s": t_ours,
        "ours_one_thread_s": t_one,
        "speedup": t_stock / t_ours,
        "speedup_one_thread": t_stock / t_one,
        "equal": True,
    }
    path = write_record(result, RESULTS_DIR, "lm_eval_tokenize")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
