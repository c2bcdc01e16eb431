"""lm-eval workloads (issue 13 acceptance 3b, 3c): stock HFLM and the paged adapter in one process.

* ``loglikelihood`` (3c): ``--contexts`` contexts of ``--ctx-len`` +- 10% random tokens, each with
  ``--conts`` continuations of 5-30 tokens (default 250 x 4 = 1,000 requests), through
  ``HFLM._loglikelihood_tokens`` (what ``loglikelihood`` calls after tokenizing). Stock runs at
  ``--batch-size`` (16) on the first ``--stock-requests`` requests (default: all); ours runs all
  of them in one engine run. Both first run a warm-up of the same shape drawn with another seed
  (stock: two batches; ours: the whole set), so neither timed run pays for kernel compiles.
  Reported: requests/s of each on the same requests, the ratio, the
  prefix-cache hit rate of our run, and how far our loglikelihoods / is_greedy flags are from
  stock's (bf16: not bit-equal, both are reported).
* ``generate_until`` (3b): ``--gen-requests`` prompts of 100-1024 random characters, greedy,
  ``until=["\\n\\n"]``, ``max_gen_toks`` tokens, through ``HFLM.generate_until`` on the engine,
  against the same requests run directly by the same engine (``engine.run``, what
  ``LLM.generate`` runs) with the same stop strings, and again without stop strings and each
  request's own token count as max_tokens (the same tokens; overlapped stepping applies). Stock HFLM at ``--batch-size`` on the first
  ``--stock-gen-requests`` (default 32) for reference. A warm-up run of generate_until on a
  same-shape set drawn with another seed comes first; the Triton compiles inside each timed
  run are counted.

Model: random bf16 weights of ``--arch`` (default Qwen3-0.6B shape); tokenizer: the character
tokenizer padded to the model's vocabulary (``hf_paged.testing.build_char_tokenizer``).
Results: evaluation/results/lm_eval_<UTC>.json.

GPU (lm-eval travels as wheels, see tools/gpu-wheels.sh: make gpu-wheels):
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:. \
    python3 evaluation/bench_lm_eval.py
Smoke (CPU): PYTHONPATH=. .venv/bin/python evaluation/bench_lm_eval.py --smoke
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import sync
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import (
    TritonCompileLog,
    environment,
    log,
    write_record,
)


def loglikelihood_requests(contexts: int, conts: int, ctx_len: int, vocab: int, seed: int):
    """[(None, context ids, continuation ids)] grouped by context (as lm-eval emits them)."""
    rng = random.Random(seed)
    out = []
    for _ in range(contexts):
        n = rng.randint(int(ctx_len * 0.9), int(ctx_len * 1.1))
        ctx = [rng.randrange(vocab) for _ in range(n)]
        for _ in range(conts):
            out.append((None, ctx, [rng.randrange(vocab) for _ in range(rng.randint(5, 30))]))
    return out


def timed(fn, *args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync(device)
    t0 = time.perf_counter()
    out = fn(*args)
    sync(device)
    return out, time.perf_counter() - t0


def bench_loglikelihood(lm, args, dispatch) -> dict:
    vocab = min(10000, lm.model.config.vocab_size)
    reqs = loglikelihood_requests(args.contexts, args.conts, args.ctx_len, vocab, seed=0)
    n_stock = min(args.stock_requests or len(reqs), len(reqs))
    # warm-up for both on requests of the same shape drawn with another seed (no prefix shared
    # with the timed ones): kernels compiled and memory pools grown before the timed runs
    warm = loglikelihood_requests(args.contexts, args.conts, args.ctx_len, vocab, seed=1)
    dispatch.set_default_backend("hf")
    lm._loglikelihood_tokens(warm[: 2 * args.batch_size])
    stock, t_stock = timed(lm._loglikelihood_tokens, reqs[:n_stock])
    log(f"loglikelihood stock bs={args.batch_size}: {n_stock} requests in {t_stock:.2f}s")
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    dispatch.set_default_backend("paged")
    lm._loglikelihood_tokens(warm)  # engine start-up and a whole run of the same shape
    engine = dispatch.get_engine(lm.model)
    engine.block_manager.reset_stats()
    engine.block_manager.reset_prefix_cache()
    before = engine.stats
    ours, t_ours = timed(lm._loglikelihood_tokens, reqs)
    after = engine.stats
    hit_rate = after["prefix_cache_hit_rate"]
    for name, row in (after.get("profile") or {}).items():  # HF_PAGED_PROFILE=1
        log(f"loglikelihood profile {name:>15}: {row['total_s']:7.3f} s, {row['calls']} calls")
    ours_sub, t_sub = timed(lm._loglikelihood_tokens, reqs[:n_stock])  # cache warm: reported only
    log(f"loglikelihood paged: {len(reqs)} requests in {t_ours:.2f}s, hit rate {hit_rate:.3f}")
    diffs = [abs(a[0] - b[0]) for a, b in zip(stock, ours[:n_stock])]
    return {
        "requests": len(reqs),
        "stock_requests": n_stock,
        "stock_s": t_stock,
        "stock_req_per_s": n_stock / t_stock,
        "paged_s": t_ours,
        "paged_req_per_s": len(reqs) / t_ours,
        "speedup": (len(reqs) / t_ours) / (n_stock / t_stock),
        "prefix_cache_hit_rate": hit_rate,
        "overlapped_steps": after["num_overlapped_steps"] - before["num_overlapped_steps"],
        "held_back": after["num_held_back"] - before["num_held_back"],
        "paged_again_on_stock_subset_s": t_sub,
        "max_abs_loglikelihood_diff": max(diffs),
        "mean_abs_loglikelihood_diff": sum(diffs) / len(diffs),
        "is_greedy_agree": sum(a[1] == b[1] for a, b in zip(stock, ours)) / n_stock,
        "same_as_rerun": all(abs(a[0] - b[0]) < 1e-3 for a, b in zip(ours, ours_sub)),
    }


def bench_generate(lm, args, dispatch) -> dict:
    from lm_eval.api.instance import Instance

    from hf_paged.engine.core.request import EngineRequest
    from hf_paged.engine.stop_strings import StopStrings

    gen_kwargs = {"until": ["\n\n"], "max_gen_toks": args.max_gen_toks, "do_sample": False}

    def draw(seed: int) -> list[str]:
        rng = random.Random(seed)
        chars = [chr(c) for c in range(33, 127)]
        return ["".join(rng.choices(chars, k=rng.randint(100, 1024))) for _ in range(args.gen_requests)]  # fmt: skip

    def instances(texts: list[str]) -> list:
        return [Instance("generate_until", {}, (t, dict(gen_kwargs)), i) for i, t in enumerate(texts)]  # fmt: skip

    texts = draw(2)
    inst = instances(texts)
    dispatch.set_default_backend("paged")
    # warm-up on a same-shape set drawn with another seed (no prefix shared with the timed
    # one): the Triton kernels a whole run specializes are compiled before any timed run
    lm.generate_until(instances(draw(3)), disable_tqdm=True)
    engine = dispatch.get_engine(lm.model)
    # every timed run starts from an empty prefix cache: the runs share their prompts, so
    # a run after another would otherwise skip most of its prefill
    engine.block_manager.reset_prefix_cache()
    with TritonCompileLog() as c_ours:
        ours, t_ours = timed(lm.generate_until, inst)
    engine = dispatch.get_engine(lm.model)  # the one that served it (a call may rebuild it)
    until = ("\n\n", lm.tok_decode(lm.eot_token_id, skip_special_tokens=False))
    stops = StopStrings.build(lm.tokenizer, until)
    params = engine_params(args.max_gen_toks, until)
    reqs = [EngineRequest(lm.tok_encode(t), params, stop_strings=stops) for t in texts]
    engine.block_manager.reset_prefix_cache()
    with TritonCompileLog() as c_llm:
        outs, t_llm = timed(engine.run, reqs)
    tokens = sum(len(o.token_ids) for o in outs)
    plain = [EngineRequest(r.prompt_token_ids, engine_params(len(o.token_ids), ())) for r, o in
             zip(reqs, outs)]  # fmt: skip
    engine.block_manager.reset_prefix_cache()
    _, t_plain = timed(engine.run, plain)  # the same tokens, no stop strings: overlap-eligible
    same = sum(lm.tok_decode(o.token_ids).split("\n\n")[0] == s for o, s in zip(outs, ours))
    if args.profile:  # one more generate_until run under cProfile, after the timed ones
        import cProfile
        import pstats

        engine.block_manager.reset_prefix_cache()
        prof = cProfile.Profile()
        prof.runcall(lm.generate_until, inst)
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    dispatch.set_default_backend("hf")
    n_stock = min(args.stock_gen_requests, len(inst))
    _, t_stock = timed(lm.generate_until, inst[:n_stock])
    log(
        f"Triton compiles in the timed runs: generate_until {c_ours.summary()['count']}, "
        f"engine.run {c_llm.summary()['count']}"
    )
    log(
        f"generate_until paged {t_ours:.2f}s, engine.run {t_llm:.2f}s (no stop strings "
        f"{t_plain:.2f}s), stock {t_stock:.2f}s on {n_stock}"
    )
    return {
        "requests": len(inst),
        "generated_tokens_engine_run": tokens,
        "paged_generate_until_s": t_ours,
        "engine_run_s": t_llm,
        "ratio_vs_engine_run": t_llm / t_ours,
        "engine_run_no_stop_s": t_plain,
        "ratio_vs_engine_run_no_stop": t_plain / t_ours,
        "paged_tok_per_s": tokens / t_ours,
        "engine_run_tok_per_s": tokens / t_llm,
        "same_text_as_engine_run": same / len(inst),
        "stock_requests": n_stock,
        "stock_s": t_stock,
        "triton_compiles_generate_until": c_ours.summary(),
        "triton_compiles_engine_run": c_llm.summary(),
    }


def engine_params(max_tokens: int, until: tuple[str, ...]):
    from hf_paged import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, stop=until)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3-0.6b")
    p.add_argument("--contexts", type=int, default=250)
    p.add_argument("--conts", type=int, default=4)
    p.add_argument("--ctx-len", type=int, default=500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--stock-requests", type=int, default=None)
    p.add_argument("--gen-requests", type=int, default=256)
    p.add_argument("--max-gen-toks", type=int, default=256)
    p.add_argument("--stock-gen-requests", type=int, default=32)
    p.add_argument("--only", choices=("loglikelihood", "generate_until"), default=None)
    p.add_argument("--profile", action="store_true", help="cProfile one more generate_until run")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU, few requests")
    args = p.parse_args()
    if args.smoke:
        args.arch, args.contexts, args.ctx_len, args.gen_requests = "tiny", 6, 60, 6
        args.max_gen_toks, args.stock_gen_requests = 8, 4
    from lm_eval.models.huggingface import HFLM

    import hf_paged  # noqa: F401
    from hf_paged.integration import dispatch
    from hf_paged.integration.lm_eval import install_lm_eval
    from hf_paged.testing import build_char_tokenizer

    install_lm_eval()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_random_model(args.arch, device=device, dtype=dtype)
    tok = build_char_tokenizer(vocab_size=model.config.vocab_size)
    lm = HFLM(
        pretrained=model, tokenizer=tok, batch_size=args.batch_size, max_length=2048, device=device
    )
    result = {"env": environment(), "args": vars(args)}
    if args.only in (None, "loglikelihood"):
        result["loglikelihood"] = bench_loglikelihood(lm, args, dispatch)
    if args.only in (None, "generate_until"):
        result["generate_until"] = bench_generate(lm, args, dispatch)
    path = write_record(result, RESULTS_DIR, f"lm_eval{'_smoke' if args.smoke else ''}")
    print(json.dumps({k: v for k, v in result.items() if k != "env"}, indent=2))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
