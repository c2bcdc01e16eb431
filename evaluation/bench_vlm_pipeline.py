"""``pipeline("image-text-to-text", backend="paged")`` vs ``LLM.generate`` on the same (image,
prompt) pairs, one process, CPU, tiny Gemma 3 (``hf_paged/testing/vlm/frontends.py``).

Each pair is one generated 16x16 image and a question; both systems run the same processor
outputs greedy with the same number of new tokens (EOS ignored), each on its own engine built
from the same in-memory model and options:

* ``llm``: ``LLM(model, processor=...).generate([{"prompt": text, "multi_modal_data":
  {"image": image}}, ...])``.
* ``pipeline``: the image pipeline on a generator of ``{"images": image, "text": prompt}`` pairs
  at ``batch_size=1`` (stock calls ``generate`` once per pair; the paged pipeline streams all
  pairs into one engine run), ``return_full_text=False``: preprocessing and decoding included in
  its time.

Both build a fresh engine and warm it on two other pairs first (not timed); the encoder cache is
cleared by the fresh engine, so each timed call runs the vision tower on every image. Metric:
requested new tokens / wall time; ratio pipeline / llm (the goal: >= 0.85). Writes
``evaluation/results/vlm_pipeline_<stamp>.json`` with both rows and whether every pipeline text
equals the LLM's decoded tokens.

    PYTHONPATH=. OMP_NUM_THREADS=1 python evaluation/bench_vlm_pipeline.py
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from results_dir import RESULTS_DIR

from hf_paged.benchmarks.run_record import environment, log, write_record


def _pairs(n: int, seed: int):
    from hf_paged.testing.vlm.frontends import make_images

    images = make_images(n, seed=seed)
    texts = [f"Describe image {i}: " + "what is in it? " * (1 + i % 3) for i in range(n)]
    return images, texts


def _prompt(text: str) -> str:
    """The prompt text both systems get: the image placeholder, then the question."""
    return f"<user><start_of_image>{text}\n<assistant>"


def run_llm(model, processor, images, texts, max_new: int, ekw: dict) -> tuple[dict, list]:
    from hf_paged import LLM, SamplingParams

    def prompts(ims, ts):
        return [{"prompt": _prompt(t), "multi_modal_data": {"image": im}}
                for im, t in zip(ims, ts)]  # fmt: skip

    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    with LLM(model, processor=processor, **ekw) as llm:
        warm_images, warm_texts = _pairs(2, seed=99)
        llm.generate(prompts(warm_images, warm_texts), params, use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.generate(prompts(images, texts), params, use_tqdm=False)
        wall = time.perf_counter() - t0
        running = llm.stats["max_num_running_seqs"]
    texts_out = [processor.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
                 for o in outs]  # fmt: skip
    return _row("llm", wall, len(images) * max_new, running), texts_out


def run_pipeline(model, processor, images, texts, max_new: int, ekw: dict) -> tuple[dict, list]:
    import transformers

    import hf_paged  # noqa: F401  (installs the generate dispatcher and the pipeline wrapper)
    from hf_paged.integration import dispatch

    def pairs(ims, ts):  # a generator: stock's pipeline takes it item by item
        return ({"images": im, "text": _prompt(t)} for im, t in zip(ims, ts))

    pipe = transformers.pipeline("image-text-to-text", model=model, processor=processor,
                                 backend="paged", paged_config=ekw)  # fmt: skip
    kw = dict(max_new_tokens=max_new, generate_kwargs={"min_new_tokens": max_new},
              return_full_text=False, batch_size=1)  # fmt: skip
    try:
        warm_images, warm_texts = _pairs(2, seed=99)
        list(pipe(pairs(warm_images, warm_texts), **kw))
        t0 = time.perf_counter()
        outs = list(pipe(pairs(images, texts), **kw))
        wall = time.perf_counter() - t0
        running = dispatch.get_engine(model).stats["max_num_running_seqs"]
    finally:
        dispatch.release(model)
    row = _row("pipeline", wall, len(images) * max_new, running, batch_size=1)
    return row, [o[0]["generated_text"] for o in outs]


def _row(system: str, wall: float, tokens: int, running: int, **extra) -> dict:
    row = {"system": system, "wall_s": wall, "output_tokens": tokens, "tok_per_s": tokens / wall,
           "max_num_running_seqs": running, **extra}  # fmt: skip
    log(f"{system}: {tokens} tokens in {wall:.2f} s = {row['tok_per_s']:.0f} tok/s "
        f"(most sequences running at once: {running})")  # fmt: skip
    return row


def main(argv=None) -> Path:
    import torch

    from hf_paged.testing.vlm.frontends import build_gemma3, build_processor

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="runs of each; the best is kept")
    p.add_argument("--out-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)

    torch.set_num_threads(1)
    model = build_gemma3()
    processor = build_processor(model)
    images, texts = _pairs(args.pairs, seed=0)
    ekw = {"device": "cpu", "kv_block_size": 16, "max_model_len": 256, "max_num_seqs": 32}
    log(f"{args.pairs} (image, prompt) pairs x {args.max_new_tokens} new tokens, engine {ekw}")
    llm_rows, pipe_rows = [], []
    for _ in range(args.repeats):  # alternated, so that load on the machine hits both alike
        row, llm_texts = run_llm(model, processor, images, texts, args.max_new_tokens, ekw)
        llm_rows.append(row)
        row, pipe_texts = run_pipeline(model, processor, images, texts, args.max_new_tokens, ekw)
        pipe_rows.append(row)
    llm_row = max(llm_rows, key=lambda r: r["tok_per_s"])
    pipe_row = max(pipe_rows, key=lambda r: r["tok_per_s"])
    same = sum(a == b for a, b in zip(llm_texts, pipe_texts, strict=True))
    ratio = pipe_row["tok_per_s"] / llm_row["tok_per_s"]
    log(f"pipeline / llm = {ratio:.3f}x; {same}/{len(texts)} pipeline texts equal the LLM's")
    doc = {
        "benchmark": "vlm_pipeline", "model": "tiny gemma3 (hf_paged/testing/vlm/frontends.py)",
        "env": environment(), "dtype": "float32", "device": "cpu", "engine_kwargs": ekw,
        "num_pairs": args.pairs, "max_new_tokens": args.max_new_tokens,
        "repeats": args.repeats, "systems": [llm_row, pipe_row],
        "all_runs": {"llm": llm_rows, "pipeline": pipe_rows},
        "ratio_pipeline_over_llm": ratio, "pipeline_texts_equal_llm": same,
    }  # fmt: skip
    path = write_record(doc, args.out_dir, "vlm_pipeline")
    log(f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
