"""``hf_paged.ray.map_generate`` on a local Ray with one engine actor (one GPU where there is
one), greedy. Writes ``{row id: generated token ids}``."""

from __future__ import annotations

import argparse
import json

import ray

from hf_paged import SamplingParams
from hf_paged.entrypoints.ray import map_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    ray.init(num_cpus=4, include_dashboard=False)
    ray.data.DataContext.get_current().enable_progress_bars = False
    ds = ray.data.from_items([{"id": i, "prompt": t} for i, t in enumerate(prompts)])
    out = map_generate(ds, model=args.model, num_replicas=1, batch_size=len(prompts),
                       sampling_params=SamplingParams(temperature=0.0, max_tokens=args.new_tokens),
                       engine_kwargs={"dtype": args.dtype})  # fmt: skip
    rows = out.take_all()
    ray.shutdown()
    with open(args.out, "w") as f:
        json.dump({str(r["id"]): list(r["generation_token_ids"]) for r in rows}, f)


if __name__ == "__main__":
    main()
