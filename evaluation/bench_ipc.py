"""Per-step IPC cost of tensor parallelism on CPU: shm broadcast + a small gloo all_reduce.

A decode step at tp=2 costs rank 0 one ``WorkerGroup.broadcast`` of the step's inputs (256
sequences' last tokens, positions, context lengths and block-table deltas: a few KB pickled)
plus at least one all_reduce that waits for the worker to wake, read and join. tp=1 is the same
call with no IPC and a no-op all_reduce. Rows (microseconds per step, median and p90):

- tp1_step:        the local call only
- tp2_step:        broadcast + local call whose all_reduce waits for the worker (the real cost)
- tp2_broadcast:   broadcast alone (pickle, write, set events); the worker reads and returns
- tp2_all_reduce:  one 16-float all_reduce, both ranks already waiting in a loop

Usage: ``python evaluation/bench_ipc.py [--iters 2000]``; writes evaluation/results/ipc_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # spawned workers inherit this path

import torch  # noqa: E402

from hf_paged import envs  # noqa: E402
from hf_paged.distributed.communicator import Communicator  # noqa: E402
from hf_paged.distributed.process_group import (  # noqa: E402
    create_process_group,
    destroy_process_group,
    find_free_port,
)
from hf_paged.engine.worker.tp.workers import WorkerGroup  # noqa: E402


class BenchTarget:
    """What a ModelRunner does per decode step, minus the model: read inputs, one all_reduce."""

    def __init__(self, rank: int, world_size: int, init_address: str | None, abort_check=None):
        self.pg = None
        if world_size > 1:
            self.pg = create_process_group(
                rank, world_size, init_address, "cpu", timedelta(seconds=60), abort_check
            )
        self.comm = Communicator(rank, world_size, self.pg)
        self.x = torch.ones(16)

    def step(self, step_input: dict) -> None:
        _ = len(step_input["last_token_ids"])
        self.comm.all_reduce(self.x)

    def noop(self, step_input: dict) -> None:
        pass

    def all_reduce_loop(self, n: int) -> None:
        for _ in range(n):
            self.comm.all_reduce(self.x)

    def exit(self) -> None:
        destroy_process_group(self.pg)


def decode_step_input(num_seqs: int = 256, block_size: int = 16, seed: int = 0) -> dict:
    rng = random.Random(seed)
    context_lens = [rng.randint(100, 2048) for _ in range(num_seqs)]
    # one sequence in block_size crosses a block boundary per step and gets one new block
    new_blocks = [(i, rng.randrange(100_000)) for i in range(0, num_seqs, block_size)]
    return {
        "seq_ids": list(range(num_seqs)),
        "last_token_ids": [rng.randrange(150_000) for _ in range(num_seqs)],
        "positions": [n - 1 for n in context_lens],
        "context_lens": context_lens,
        "block_table_appends": new_blocks,
    }


def timed(fn, iters: int, warmup: int = 100) -> dict:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        fn()
        samples.append((time.perf_counter_ns() - start) / 1e3)
    samples.sort()
    return {
        "median_us": round(statistics.median(samples), 1),
        "p90_us": round(samples[int(0.9 * len(samples))], 1),
        "iters": iters,
    }


def machine_info() -> dict:
    cpu = platform.processor()
    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


def git_sha() -> str | None:
    if envs.HF_PAGED_GIT_SHA:  # a copied tree may carry a stale .git
        return envs.HF_PAGED_GIT_SHA
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or None
    except OSError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--out", type=Path, default=ROOT / "evaluation/results/ipc_cpu.json")
    args = parser.parse_args()
    msg = decode_step_input()
    rows = {}

    tp1 = BenchTarget(0, 1, None)
    rows["tp1_step"] = timed(lambda: tp1.step(msg), args.iters)

    address = f"127.0.0.1:{find_free_port()}"
    group = WorkerGroup(2, BenchTarget, address)
    rank0 = BenchTarget(0, 2, address, abort_check=group.check)
    try:
        group.wait_ready(timeout=120)

        def tp2_step():
            group.broadcast("step", msg)
            rank0.step(msg)

        rows["tp2_step"] = timed(tp2_step, args.iters)
        rows["tp2_broadcast"] = timed(lambda: group.broadcast("noop", msg), args.iters)
        n = args.iters + 100
        group.broadcast("all_reduce_loop", n)
        rows["tp2_all_reduce"] = timed(lambda: rank0.comm.all_reduce(rank0.x), args.iters)
    finally:
        group.close()
        rank0.exit()

    message_bytes = len(pickle.dumps(("step", (msg,), {}), protocol=pickle.HIGHEST_PROTOCOL))
    print(f"decode-step message: 256 sequences, {message_bytes} bytes pickled")
    print(f"{'row':<16} {'median us':>10} {'p90 us':>10}")
    for name, row in rows.items():
        print(f"{name:<16} {row['median_us']:>10.1f} {row['p90_us']:>10.1f}")
    overhead = rows["tp2_step"]["median_us"] - rows["tp1_step"]["median_us"]
    print(f"tp=2 IPC + all_reduce overhead per step: {overhead:.1f} us (median)")
    result = {
        "benchmark": "ipc_cpu",
        "git_sha": git_sha(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "hf_paged_envs": envs.snapshot(),
        "message_bytes": message_bytes,
        "rows": rows,
        "tp2_overhead_median_us": round(overhead, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
