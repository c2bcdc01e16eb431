"""One rank of a shard_generate run, started by tests/entrypoints/test_torchrun.py (as a plain process
with RANK/WORLD_SIZE, or under torchrun). Writes its ShardReport as JSON to ``--report``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from hf_paged import LLM  # noqa: E402
from hf_paged.entrypoints.torchrun import shard_generate  # noqa: E402
from tests.entrypoints.scale_utils import ENGINE, GREEDY  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--report", required=True)  # a path; "{rank}" is replaced
    p.add_argument("--rows-per-part", type=int, default=5)
    p.add_argument("--sleep-per-part", type=float, default=0.0)  # lets the test kill mid-run
    p.add_argument("--tp-rank", type=int, default=-1)  # this launcher rank uses tp=2
    p.add_argument("--user-group", action="store_true")  # init the launcher's default group
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    if args.user_group:  # the user's own group from the launcher's env, as in a training script
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == dist.get_world_size()
    tp = 2 if rank == args.tp_rank else 1
    llm = LLM(args.model, tensor_parallel_size=tp, **ENGINE)
    workers = len(mp.active_children())  # the engine's own TP workers (none at tp=1)
    if args.sleep_per_part:
        generate = llm.generate

        def slow_generate(*a, **k):
            out = generate(*a, **k)
            time.sleep(args.sleep_per_part)
            return out

        llm.generate = slow_generate
    report = shard_generate(
        args.data, args.out, model=llm, sampling_params=GREEDY, rows_per_part=args.rows_per_part
    )
    llm.close()
    if args.user_group:
        import torch.distributed as dist

        dist.barrier()  # the user's group still works after the engine's own group closed
        dist.destroy_process_group()
    result = dataclasses.asdict(report) | {"tp": tp, "tp_workers": workers}
    with open(args.report.replace("{rank}", str(rank)), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
