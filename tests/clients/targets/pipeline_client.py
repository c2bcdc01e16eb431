"""A text-generation pipeline over a list at its default ``batch_size``, then over a
``KeyDataset``; ``--paged`` adds ``backend="paged"`` (what a user changes) and then times
``hf_paged.LLM`` on the same token ids in this process (the pipeline's engine released first).
Writes the texts and the timed calls' wall times."""

from __future__ import annotations

import argparse
import json
import time

import torch
from transformers import pipeline
from transformers.pipelines.pt_utils import KeyDataset


def timed(fn, device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--paged", action="store_true")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    extra = {}
    if args.paged:
        import hf_paged  # noqa: F401  (installs the pipeline's paged backend)

        extra["backend"] = "paged"
    pipe = pipeline("text-generation", model=args.model, device=args.device,
                    dtype=getattr(torch, args.dtype), **extra)  # fmt: skip
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, return_full_text=False)
    pipe(prompts[:1], **{**kw, "max_new_tokens": 2})  # warm-up (kernels, engine start)
    outs, list_s = timed(lambda: pipe(prompts, **kw), args.device)
    rows = KeyDataset([{"text": t} for t in prompts], "text")
    outs_kd, kd_s = timed(lambda: list(pipe(rows, **kw)), args.device)
    doc = {"list": [o[0]["generated_text"] for o in outs], "list_s": list_s,
           "keydataset": [o[0]["generated_text"] for o in outs_kd], "keydataset_s": kd_s}  # fmt: skip
    if args.paged:
        doc.update(llm_on_same_ids(pipe, prompts, args))
    with open(args.out, "w") as f:
        json.dump(doc, f)


def llm_on_same_ids(pipe, prompts, args) -> dict:
    from hf_paged import LLM, SamplingParams
    from hf_paged.integration import dispatch

    ids = [pipe.tokenizer(t)["input_ids"] for t in prompts]
    dispatch.release(pipe.model)  # one engine at a time at the default share
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    with LLM(args.model, dtype=args.dtype) as llm:
        llm.generate(ids[:1], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)
        outs, llm_s = timed(lambda: llm.generate(ids, params, use_tqdm=False), args.device)
        texts = [o.outputs[0].text for o in outs]
    return {"llm": texts, "llm_s": llm_s}


if __name__ == "__main__":
    main()
