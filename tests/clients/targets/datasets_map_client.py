"""``datasets.Dataset.map`` with ``hf_paged.paged_generate_map`` (its docstring's recipe), greedy.
Writes the generated texts in row order and the map's wall time."""

from __future__ import annotations

import argparse
import json
import time

from datasets import Dataset

from hf_paged import paged_generate_map


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
    ds = Dataset.from_dict({"prompt": prompts})
    fn = paged_generate_map(args.model, column="prompt", output_column="generated",
                            max_new_tokens=args.new_tokens, do_sample=False,
                            paged_config={"dtype": args.dtype}, use_tqdm=False)  # fmt: skip
    t0 = time.perf_counter()
    out = ds.map(fn, **fn.map_kwargs)
    map_s = time.perf_counter() - t0
    fn.close()
    with open(args.out, "w") as f:
        json.dump({"texts": list(out["generated"]), "map_s": map_s}, f)


if __name__ == "__main__":
    main()
