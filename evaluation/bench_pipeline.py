"""Pipeline vs LLM.generate on the same requests (issue 13, acceptance 3a), one process.

The requests are W1's 256 prompts (token ids, ``workloads.get_workload``), each with the same
number of new tokens (a pipeline call takes one ``max_new_tokens`` for all its inputs; default:
the mean of W1's output lengths). A pipeline takes text: a word-level tokenizer with one word
``t<id>`` per id of the model's vocabulary decodes each prompt to text that tokenizes back to
exactly its ids (checked), so both systems run the same token sequences, greedy, EOS ignored.

Systems, each on its own engine built from the same in-memory model and engine options:

* ``llm``: ``LLM(model).generate(prompt_ids, SamplingParams(max_tokens=N))``.
* ``pipeline``: ``pipeline("text-generation", model=model, backend="paged")`` called on the list
  of prompt texts with ``batch_size`` (default 1), ``max_new_tokens=N``, ``do_sample=False``,
  ``return_full_text=False``: preprocessing and decoding included in its time.

Metric: requested new tokens / wall time of the timed call (engine start and a warm-up call are
not timed). Writes ``evaluation/results/pipeline_<workload>_<stamp>.json`` with both rows, the
ratio pipeline / llm and how many pipeline texts equal the LLM's decoded tokens.

    PYTHONPATH=. python evaluation/bench_pipeline.py                 # H200
    PYTHONPATH=. python evaluation/bench_pipeline.py --smoke         # CPU, tiny model
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, sync
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.benchmarks.workloads import get_workload


def word_tokenizer(vocab_size: int):
    """One word ``t<id>`` per id, split on whitespace, decoded space-joined; no special tokens
    are added to a prompt (``t0`` doubles as the pad token, the models' pad_token_id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", unk_token="t0")


def prompt_texts(tokenizer, prompts: list[list[int]]) -> list[str]:
    """Each prompt as text; raises if a text does not tokenize back to its ids."""
    texts = [" ".join(f"t{i}" for i in p) for p in prompts]
    for k, (text, ids) in enumerate(zip(texts, prompts, strict=True)):
        if tokenizer(text)["input_ids"] != ids:
            raise RuntimeError(f"prompt {k} does not round-trip through the word tokenizer")
    return texts


def run_llm(model, prompts, max_new: int, engine_kwargs: dict) -> tuple[dict, list[list[int]]]:
    from hf_paged import LLM, SamplingParams

    llm = LLM(model, **engine_kwargs)
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([[1, 2, 3, 4], [5, 6]], warm, use_tqdm=False)
        params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
        sync(model.device)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        sync(model.device)
        wall = time.perf_counter() - t0
        stats = llm.stats
    finally:
        llm.close()
        free_memory(model.device)
    ids = [list(o.outputs[0].token_ids) for o in outs]
    return _row("llm", wall, len(prompts) * max_new, stats), ids


def run_pipeline(model, tokenizer, texts, max_new: int, batch_size: int, engine_kwargs: dict):
    import transformers

    import hf_paged  # noqa: F401  (installs the generate dispatcher and the pipeline wrapper)
    from hf_paged.integration import dispatch

    pipe = transformers.pipeline(
        "text-generation", model=model, tokenizer=tokenizer, backend="paged",
        paged_config=engine_kwargs, device=model.device,
    )  # fmt: skip
    kw = dict(max_new_tokens=max_new, do_sample=False, return_full_text=False)
    try:
        pipe(texts[:2], batch_size=batch_size, **{**kw, "max_new_tokens": 4})  # warm-up
        stats0 = dispatch.get_engine(model).stats
        sync(model.device)
        t0 = time.perf_counter()
        outs = pipe(texts, batch_size=batch_size, **kw)
        sync(model.device)
        wall = time.perf_counter() - t0
        stats = dispatch.get_engine(model).stats
    finally:
        dispatch.release(model)
        free_memory(model.device)
    row = _row("pipeline", wall, len(texts) * max_new, stats, batch_size=batch_size)
    row["num_preemptions"] = stats["num_preemptions"] - stats0["num_preemptions"]
    return row, [o[0]["generated_text"] for o in outs]


def _row(system: str, wall: float, tokens: int, stats: dict, **extra) -> dict:
    row = {"system": system, "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
           "max_num_running_seqs": stats["max_num_running_seqs"],
           "num_preemptions": stats["num_preemptions"], **extra}  # fmt: skip
    log(f"{system}: {tokens} tokens in {wall:.2f} s = {row['tok_per_s']:.0f} tok/s "
        f"(most sequences running at once: {row['max_num_running_seqs']})")  # fmt: skip
    return row


def main(argv=None) -> Path:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W1", choices=["W1", "W2"])
    p.add_argument("--smoke", action="store_true", help="tiny model, 8 requests, CPU")
    p.add_argument("--device", default="cuda")
    p.add_argument("--batch-size", type=int, default=1, help="the pipeline's batch_size")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default: mean W1 output")
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)

    wl = get_workload(args.workload, smoke=args.smoke)
    device = "cpu" if args.smoke else args.device
    dtype = torch.float32 if args.smoke else torch.bfloat16
    max_new = args.max_new_tokens or round(statistics.mean(wl.output_lens))
    ekw = {"device": device}
    if args.max_num_seqs is not None:
        ekw["max_num_seqs"] = args.max_num_seqs
    model = build_random_model(wl.arch, device, dtype)
    tokenizer = word_tokenizer(model.config.vocab_size)
    texts = prompt_texts(tokenizer, wl.prompts)
    log(f"{wl.name}: {wl.num_requests} prompts ({wl.num_prompt_tokens} tokens) x {max_new} new "
        f"tokens, engine {ekw}")  # fmt: skip

    llm_row, llm_ids = run_llm(model, wl.prompts, max_new, ekw)
    pipe_row, pipe_texts = run_pipeline(model, tokenizer, texts, max_new, args.batch_size, ekw)
    llm_texts = [tokenizer.decode(ids) for ids in llm_ids]
    same = sum(a == b for a, b in zip(llm_texts, pipe_texts, strict=True))
    ratio = pipe_row["tok_per_s"] / llm_row["tok_per_s"]
    log(f"pipeline / llm = {ratio:.3f}x; {same}/{len(texts)} pipeline texts equal the LLM's")
    doc = {
        "benchmark": "pipeline", "workload": wl.name, "arch": wl.arch, "smoke": args.smoke,
        "env": environment(), "dtype": str(dtype), "device": device, "engine_kwargs": ekw,
        "num_requests": wl.num_requests, "max_new_tokens": max_new,
        "systems": [llm_row, pipe_row], "ratio_pipeline_over_llm": ratio,
        "pipeline_texts_equal_llm": same,
    }  # fmt: skip
    path = write_record(doc, args.out_dir, f"pipeline_{wl.name}{'_smoke' if args.smoke else ''}")
    log(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
