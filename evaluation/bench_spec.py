"""Speculative decoding at batch 1 (issue 25, acceptance 4): prompt lookup and a draft model on
the 8B shape, against our plain decode (L1) and stock ``generate``, all in one process.

Model: the Llama-3-8B architecture with random bf16 weights (``random_models.build_random_model``);
draft: the Llama-3.2-1B shape (same vocabulary), random weights of its own. Greedy, batch 1,
``--new-tokens`` (256) new tokens, EOS never set.

Workloads (prompts of token ids):

* ``plain``: L1's 512-token random prompt P. Our plain decode on it is the baseline (``llm``);
  its 256 greedy tokens G are used below.
* ``lookup_hit``: P + G + P, the model's own greedy output placed in the prompt: after the
  second P, the tokens that followed P before are in the context, so prompt lookup proposes
  them. The acceptance rate says how far the model repeats itself (random weights give no
  guarantee; it is measured, not assumed). Goal: >= 1.8x ``llm`` tokens/s.
* ``lookup_miss``: P + G' + P with every token of G shifted by one id: the lookup proposes
  tokens the model does not produce, every step (the worst case of proposing). Goal: >= 0.9x.
* ``plain`` with prompt lookup too (random prompts: lookups find little to propose).
* ``draft``: the 1B-shaped draft proposing for the 8B (stock's defaults: 20 tokens, constant
  schedule, confidence threshold 0.4), on P and on ``lookup_hit``: tokens/s and acceptance.

Rows: ours through ``LLM``'s engine (one request stepped by hand; ms/token = time from the step
that produced the first token to the last, over the tokens after the first), and stock
``generate`` (sdpa, dynamic cache) with the same arguments (``prompt_lookup_num_tokens``,
``assistant_model``) and plain, timed whole (prefill included; stock's TTFT at 512 tokens is a
few ms of its ~15 s). Every row's tokens are checked against our plain greedy of the same
prompt (greedy speculation must not change a token).

Memory: each engine is given its share of the GPU (``gpu_memory_utilization``, per engine):
the target ``--target-memory`` (default 0.55), the draft ``--draft-memory`` (default 0.25; the
stock models built for the baseline hold ~18 GiB beside them).

Usage (GPU): PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_spec.py
Smoke (CPU): PYTHONPATH=. .venv/bin/python evaluation/bench_spec.py --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, mem_str, sync
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import environment, log, markdown_table, utc_stamp
from hf_paged.benchmarks.workloads import make_requests
from hf_paged.engine.core.request import EngineRequest  # noqa: E402


def run_ours(engine, prompt, n_new, device, proposer=None) -> dict:
    """One request stepped to completion; ms/token over the tokens after the first."""
    from hf_paged import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=n_new, ignore_eos=True)
    before = dict(engine.stats)
    rid = engine.add_request(EngineRequest(prompt, params, proposer=proposer))
    seq = engine.requests.by_id[rid].seqs[0]
    sync(device)
    t0, t_first, steps, done = time.perf_counter(), None, 0, None
    while done is None:
        res = engine.step()
        steps += 1
        if t_first is None and (seq.num_output_tokens >= 1 or res.finished):
            t_first, first_n = time.perf_counter(), max(1, seq.num_output_tokens)
        done = next((o for o in res.finished if o.request_id == rid), None)
    t_end = time.perf_counter()
    tokens = list(done.outputs[0].token_ids)
    assert len(tokens) == n_new, (len(tokens), n_new)
    s = engine.stats
    drafted = s["spec_num_draft_tokens"] - before["spec_num_draft_tokens"]
    kept = s["spec_num_accepted_tokens"] - before["spec_num_accepted_tokens"]
    ms = (t_end - t_first) / (n_new - first_n) * 1e3
    return {
        "ms_per_token": ms, "tokens_per_s": 1e3 / ms, "total_s": t_end - t0, "steps": steps,
        "draft_tokens": drafted, "accepted_tokens": kept,
        "acceptance_rate": kept / drafted if drafted else None,
        "spec_chunks": s["spec_num_chunks"] - before["spec_num_chunks"], "tokens": tokens,
    }  # fmt: skip


def run_stock(model, prompt, n_new, device, **extra) -> dict:
    """Stock ``generate`` timed whole (``backend="hf"``: stock whatever the environment)."""
    ids = torch.tensor([prompt], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=n_new, do_sample=False,
              pad_token_id=0, **extra)  # fmt: skip
    try:
        from hf_paged.integration import is_installed

        if is_installed():
            kw["backend"] = "hf"
    except Exception:  # noqa: BLE001 - no dispatcher: plain stock generate
        pass
    model.generate(ids[:, :32], **{**kw, "max_new_tokens": 4})  # warm-up
    sync(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, **kw)
    sync(device)
    dt = time.perf_counter() - t0
    n = out.shape[1] - ids.shape[1]
    return {"ms_per_token": dt / n * 1e3, "tokens_per_s": n / dt, "total_s": dt,
            "tokens": out[0, ids.shape[1] :].tolist()}  # fmt: skip


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="llama3-8b")
    p.add_argument("--draft-arch", default="llama3.2-1b")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--lookup-tokens", type=int, default=10, help="prompt_lookup_num_tokens")
    p.add_argument("--max-ngram", type=int, default=2, help="max_matching_ngram_size")
    p.add_argument("--draft-tokens", type=int, default=20, help="num_assistant_tokens")
    p.add_argument("--draft-threshold", type=float, default=0.4,
                   help="assistant_confidence_threshold (0 = off)")  # fmt: skip
    p.add_argument("--no-backoff", action="store_true", help="prompt lookup proposes every step")
    p.add_argument("--target-memory", type=float, default=0.55)
    p.add_argument("--draft-memory", type=float, default=0.25)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--skip-stock", action="store_true")
    p.add_argument("--skip-draft", action="store_true")
    p.add_argument("--device", default="cuda")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, fp32, tiny models, 32 + 16 tokens")
    args = p.parse_args(argv)
    if args.smoke:
        args.arch, args.draft_arch, args.device = "tiny", "tiny-llama", "cpu"
        args.prompt_len, args.new_tokens, args.max_model_len = 32, 16, 256
        args.out_dir = args.out_dir or "/tmp/hf_paged_bench_smoke"
    from hf_paged import LLM
    from hf_paged.engine.spec.proposers import DraftModelProposer, NgramProposer

    device = args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16
    vocab = 500 if args.smoke else 10000
    n_new = args.new_tokens
    (prompt,), _ = make_requests(1, (args.prompt_len,) * 2, (1, 1), vocab, seed=0)
    (warm,), _ = make_requests(1, (args.prompt_len,) * 2, (1, 1), vocab, seed=1)
    model = build_random_model(args.arch, device, dtype)
    draft = None if args.skip_draft else build_random_model(args.draft_arch, device, dtype, seed=1)
    sync(device)
    log(f"models built ({mem_str(device)})")

    def engine_kwargs(share):
        kw = {"max_model_len": args.max_model_len}
        if device == "cpu":
            kw["device"] = "cpu"
        else:
            kw["gpu_memory_utilization"] = share
        return kw

    rows, prompts = [], {}
    t = time.perf_counter()
    target = LLM(model, **engine_kwargs(args.target_memory))
    log(f"target engine up in {time.perf_counter() - t:.1f} s ({mem_str(device)})")
    eng = target.engine
    lookup = lambda: NgramProposer(args.lookup_tokens, args.max_ngram,  # noqa: E731
                                   backoff=not args.no_backoff)  # fmt: skip

    def ours(name, workload, proposer=None, reference=None):
        r = run_ours(eng, prompts[workload], n_new, device, proposer)
        r.update(system=name, workload=workload)
        if reference is not None:
            r["tokens_match_plain"] = r["tokens"] == reference
        log(f"{name} on {workload}: {r['ms_per_token']:.2f} ms/token, acceptance "
            f"{r['acceptance_rate']}, steps {r['steps']}")  # fmt: skip
        rows.append(r)
        return r

    try:
        prompts["plain"] = prompt
        run_ours(eng, warm, n_new, device)  # warm-up: compiles, fills nothing we reuse
        run_ours(eng, warm, n_new, device, lookup())
        plain = ours("llm", "plain")
        g = plain["tokens"]
        prompts["lookup_hit"] = prompt + g + prompt
        prompts["lookup_miss"] = prompt + [(t + 1) % vocab for t in g] + prompt
        refs = {"plain": g}
        for w in ("lookup_hit", "lookup_miss"):
            refs[w] = ours("llm", w)["tokens"]
        for w in ("lookup_hit", "lookup_miss", "plain"):
            ours("llm+lookup", w, lookup(), refs[w])
        if draft is not None:
            t = time.perf_counter()
            dllm = LLM(draft, **engine_kwargs(args.draft_memory))
            log(f"draft engine up in {time.perf_counter() - t:.1f} s ({mem_str(device)})")
            try:
                mk = lambda: DraftModelProposer(dllm.engine, args.draft_tokens,  # noqa: E731
                                                confidence_threshold=args.draft_threshold)  # fmt: skip
                run_ours(eng, warm, n_new, device, mk())  # warm-up
                for w in ("plain", "lookup_hit"):
                    ours("llm+draft", w, mk(), refs[w])
            finally:
                dllm.close()
        engine_config = dataclasses.asdict(eng.config)
    finally:
        target.close()
        free_memory(device)

    if not args.skip_stock:
        for w, extra, name in [
            ("plain", {}, "stock"),
            ("lookup_hit", {}, "stock"),
            ("lookup_hit", {"prompt_lookup_num_tokens": args.lookup_tokens,
                            "max_matching_ngram_size": args.max_ngram}, "stock+lookup"),
            ("lookup_miss", {"prompt_lookup_num_tokens": args.lookup_tokens,
                             "max_matching_ngram_size": args.max_ngram}, "stock+lookup"),
        ] + ([("plain", {"assistant_model": draft}, "stock+draft")] if draft is not None else []):  # fmt: skip
            if draft is not None:
                draft.generation_config.num_assistant_tokens = args.draft_tokens
                draft.generation_config.assistant_confidence_threshold = args.draft_threshold
            r = run_stock(model, prompts[w], n_new, device, **extra)
            r.update(system=name, workload=w, tokens_match_plain=r["tokens"] == refs[w])
            log(f"{name} on {w}: {r['ms_per_token']:.2f} ms/token")
            rows.append(r)
            free_memory(device)

    base = next(r for r in rows if r["system"] == "llm" and r["workload"] == "plain")
    for r in rows:
        r["vs_llm_plain"] = r["tokens_per_s"] / base["tokens_per_s"]
    table = markdown_table(
        ["system", "workload", "ms/token", "tok/s", "vs llm plain", "acceptance", "same tokens"],
        [[r["system"], r["workload"], f"{r['ms_per_token']:.2f}", f"{r['tokens_per_s']:.1f}",
          f"{r['vs_llm_plain']:.2f}x",
          "" if r.get("acceptance_rate") is None else f"{r['acceptance_rate']:.3f}",
          r.get("tokens_match_plain", "")] for r in rows],
    )  # fmt: skip
    print(table)
    out_dir = Path(args.out_dir) if args.out_dir else RESULTS_DIR
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"spec_{utc_stamp()}.json"
    for r in rows:
        r["tokens"] = r["tokens"][:16]  # a prefix: enough to eyeball, not megabytes
    path.write_text(json.dumps({
        "env": environment(), "args": vars(args), "engine_config": engine_config,
        "rows": rows, "table": table,
    }, indent=1, default=str))  # fmt: skip
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
