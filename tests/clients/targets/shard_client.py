"""``hf_paged.shard_generate`` in one launcher rank (``torchrun --nproc-per-node 1 ...``): its
slice of a parquet file through one engine, as parquet parts in ``--out``, greedy."""

from __future__ import annotations

import argparse

from hf_paged import SamplingParams, shard_generate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--data", required=True)
    p.add_argument("--new-tokens", type=int, required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    report = shard_generate(args.data, args.out, model=args.model, rows_per_part=8,
                            sampling_params=SamplingParams(temperature=0.0,
                                                           max_tokens=args.new_tokens),
                            dtype=args.dtype)  # fmt: skip
    print(f"rank {report.rank}/{report.world_size}: {report.rows_generated} rows, "
          f"{len(report.written)} parts")  # fmt: skip


if __name__ == "__main__":
    main()
