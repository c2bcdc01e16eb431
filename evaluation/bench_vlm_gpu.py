"""Vision-language models at speed on one GPU: ``LLM`` vs the paged image pipeline at
``batch_size=1`` vs stock ``generate`` in padded batches, one process, one model in memory.

Workload (``hf_paged/benchmarks/vlm.py``): Qwen2.5-VL-7B's shape with random bf16 weights; 128
requests, each with one 448x448 image (256 placeholder tokens; a quarter of the requests reuse
an earlier image), text of U[50, 300] tokens, outputs of U[50, 300] tokens, EOS ignored, greedy.

Systems:

* ``stock``: ``model.generate(**processor(batch), max_new_tokens=max of the batch)`` in
  left-padded batches of ``--stock-batch`` on the first ``--stock-requests`` requests; each row
  counts its requested tokens only (stock runs every row to the batch's longest).
* ``llm``: ``LLM(model, processor=...).generate`` of every request as vLLM's multimodal prompt
  ``{"prompt": text, "multi_modal_data": {"image": image}}`` with its own ``max_tokens``.
* ``pipeline`` vs ``llm_fixed``: the image pipeline (``backend="paged"``) over every
  ``{"images": image, "text": text}`` at ``batch_size=1`` with one ``max_new_tokens`` (the
  outputs' mean; a pipeline call takes one), and ``LLM`` on the same inputs and length.

Reported: requested output tokens / wall time per system, ``llm / stock`` and
``pipeline / llm_fixed``; for ``llm``, the vision tower's share of the wall time (time inside
stock's ``get_image_features``, synchronized), the encoder-cache and prefix-cache hit rates from
``llm.stats``, and the decode steps that replayed a CUDA graph. JSON to ``$OUT`` when set (the
device tool), else ``evaluation/results/vlm_gpu_<stamp>.json``.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python3 evaluation/bench_vlm_gpu.py            # H200
    PYTHONPATH=. python evaluation/bench_vlm_gpu.py --tiny                         # CPU smoke
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log, write_record
from hf_paged.benchmarks.vlm import build_model, build_processor, vlm_requests


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


class TowerClock:
    """Seconds spent in the model's ``get_image_features`` (the vision tower and projector)."""

    def __init__(self, model, device):
        self.base = getattr(model, "model", model)
        self.original = self.base.get_image_features
        self.seconds, self.calls, self.device = 0.0, 0, device

        @functools.wraps(self.original)  # the tower reads the signature for its input names
        def timed(*args, **kwargs):
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return self.original(*args, **kwargs)
            finally:
                _sync(self.device)
                self.seconds += time.perf_counter() - t0
                self.calls += 1

        self.base.get_image_features = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def close(self) -> None:
        del self.base.get_image_features  # the class's method again


def run_stock(model, processor, reqs, images, batch: int, device) -> dict:
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(reqs), batch):
        part = reqs[i : i + batch]
        inputs = processor(text=[r.text for r in part],
                           images=[[images[r.image_index]] for r in part],
                           return_tensors="pt", padding=True).to(device)  # fmt: skip
        longest = max(r.output_len for r in part)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, backend="hf")  # fmt: skip
        tokens += sum(r.output_len for r in part)
        log(f"  stock batch {i // batch} done")
    _sync(device)
    wall = time.perf_counter() - t0
    return dict(system="stock", requests=len(reqs), tokens=tokens, seconds=wall,
                tok_per_s=tokens / wall)  # fmt: skip


def _prompts(reqs, images):
    return [{"prompt": r.text, "multi_modal_data": {"image": images[r.image_index]}} for r in reqs]


def count_graph_replays(llm):
    """Wrap the decode graph runner's ``replay``; returns a dict counting replays."""
    runner = llm.engine.executor.runner
    counter = {"replays": 0, "reason_none": runner.cuda_graph_reason is None,
               "reason": runner.cuda_graph_reason}  # fmt: skip
    graphs = getattr(runner, "graph_runner", None)
    if graphs is not None:
        original = graphs.replay

        def replay(*args, **kwargs):
            counter["replays"] += 1
            return original(*args, **kwargs)

        graphs.replay = replay
    return counter


def run_llm(llm, reqs, images, clock: TowerClock, device, fixed_len: int | None = None) -> dict:
    from hf_paged import SamplingParams

    params = [SamplingParams(max_tokens=fixed_len or r.output_len, temperature=0.0,
                             ignore_eos=True) for r in reqs]  # fmt: skip
    before = dict(llm.stats)
    clock.reset()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate(_prompts(reqs, images), params, use_tqdm=False)
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = sum(p.max_tokens for p in params)
    after = dict(llm.stats)
    delta = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    return dict(system="llm" if fixed_len is None else "llm_fixed", requests=len(reqs),
                tokens=tokens, seconds=wall, tok_per_s=tokens / wall,
                tower_seconds=clock.seconds, tower_calls=clock.calls,
                tower_share=clock.seconds / wall, stats_delta=delta,
                outputs=[list(o.outputs[0].token_ids) for o in outs])  # fmt: skip


def run_pipeline(model, processor, reqs, images, new_tokens: int, ekw: dict, device) -> dict:
    from transformers import pipeline

    pipe = pipeline("image-text-to-text", model=model, processor=processor, backend="paged",
                    paged_config=ekw)  # fmt: skip
    inputs = [{"images": images[r.image_index], "text": r.text} for r in reqs]
    warm = [{"images": images[0], "text": reqs[0].text}]
    # generators of {"images", "text"} dicts stream (a list of dicts would read as one chat)
    list(pipe((w for w in warm), batch_size=1, max_new_tokens=4))
    _sync(device)
    t0 = time.perf_counter()
    outs = pipe((x for x in inputs), batch_size=1, max_new_tokens=new_tokens,
                generate_kwargs={"min_new_tokens": new_tokens, "do_sample": False},
                return_full_text=False)  # fmt: skip
    outs = list(outs)
    _sync(device)
    wall = time.perf_counter() - t0
    tokens = new_tokens * len(reqs)
    return dict(system="pipeline", requests=len(reqs), tokens=tokens, seconds=wall,
                tok_per_s=tokens / wall, texts=[o[0]["generated_text"] for o in outs])  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny model, 8 requests, CPU smoke run")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--stock-requests", type=int, default=32)
    ap.add_argument("--stock-batch", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of systems to skip")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    arch, size, dtype = ("tiny", 112, torch.float32) if args.tiny else (
        "qwen2.5-vl-7b", 448, torch.bfloat16)  # fmt: skip
    n = 8 if args.tiny else args.requests
    skip = set(filter(None, args.skip.split(",")))
    log(f"building {arch} on {device}")
    model = build_model(arch, dtype, device)
    processor = build_processor(size)
    reqs, images = vlm_requests(n, size)
    log(f"{n} requests, {len(images)} distinct images")
    ekw = dict(max_num_seqs=256 if not args.tiny else 8, max_model_len=1024)
    rows, clock = [], TowerClock(model, device)
    from hf_paged import LLM

    llm = LLM(model, processor=processor, **ekw)
    replays = count_graph_replays(llm)
    run_llm(llm, reqs[:4], images, clock, device, fixed_len=4)  # warm-up (not timed)
    row = run_llm(llm, reqs, images, clock, device)
    row["graph_replays"] = dict(replays)
    rows.append(row)
    log(f"llm: {row['tok_per_s']:.1f} tok/s, tower share {row['tower_share']:.3f}, "
        f"stats {row['stats_delta']}, graphs {replays}")  # fmt: skip
    fixed = round(sum(r.output_len for r in reqs) / len(reqs))
    llm.reset_prefix_cache()
    row = run_llm(llm, reqs, images, clock, device, fixed_len=fixed)
    rows.append(row)
    log(f"llm_fixed ({fixed} new): {row['tok_per_s']:.1f} tok/s")
    llm.close()
    if "pipeline" not in skip:
        row = run_pipeline(model, processor, reqs, images, fixed, ekw, device)
        rows.append(row)
        log(f"pipeline ({fixed} new): {row['tok_per_s']:.1f} tok/s")
    if "stock" not in skip:
        k = min(n, 4 if args.tiny else args.stock_requests)
        row = run_stock(model, processor, reqs[:k], images, args.stock_batch, device)
        rows.append(row)
        log(f"stock ({k} requests): {row['tok_per_s']:.1f} tok/s")
    clock.close()
    by = {r["system"]: r for r in rows}
    ratios = {}
    if "stock" in by:
        ratios["llm_over_stock"] = by["llm"]["tok_per_s"] / by["stock"]["tok_per_s"]
    if "pipeline" in by:
        ratios["pipeline_over_llm_fixed"] = (
            by["pipeline"]["tok_per_s"] / by["llm_fixed"]["tok_per_s"]
        )
        decode = processor.tokenizer.decode
        llm_texts = [decode(ids, skip_special_tokens=True) for ids in by["llm_fixed"]["outputs"]]
        ratios["pipeline_texts_equal_llm_fixed"] = sum(
            a == b for a, b in zip(llm_texts, by["pipeline"]["texts"], strict=True)
        ) / len(llm_texts)
    log(f"ratios {ratios}")
    for r in rows:
        r.pop("outputs", None), r.pop("texts", None)
    record = dict(bench="vlm_gpu", arch=arch, device=device, env=environment(), rows=rows,
                  ratios=ratios)  # fmt: skip
    out = os.environ.get("OUT") or RESULTS_DIR
    path = write_record(record, out, f"vlm_gpu{'_tiny' if args.tiny else ''}")
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
