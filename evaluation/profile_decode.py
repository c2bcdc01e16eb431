"""Where a decode step's time goes: torch.profiler around a few steady-state decode steps.

W1's profile (HF_PAGED_PROFILE=1) showed ~5.6 ms of host time per decode step inside the forward
launch of a CUDA-graph replay and ~4.9 ms waiting for the GPU. This script answers which host
calls take that time and which kernels run per step:

    PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/profile_decode.py --out-dir "$OUT"

It builds the W1 model (random bf16 weights), queues ``--batch`` requests of ``--prompt-len``
tokens, steps until every request is decoding, then profiles ``--steps`` engine steps with CPU
and CUDA activity. Prints the top host ops by self CPU time, the kernels by CUDA time, and the
kernel launches per step; writes a Chrome trace. ``--smoke`` runs a tiny model on the CPU.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from hf_paged import LLM, SamplingParams
from hf_paged.benchmarks.random_models import build_random_model
from hf_paged.benchmarks.run_record import log
from hf_paged.engine.core.request import EngineRequest


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="qwen3-0.6b")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=600)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--sync-scheduling", action="store_true", help="async_scheduling=False")
    p.add_argument("--out-dir", default="/tmp/hf_paged_profile")
    p.add_argument("--model-impl", default="auto", choices=["auto", "native", "generic"])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU")
    args = p.parse_args()
    device = "cpu" if args.smoke else "cuda"
    arch = "tiny" if args.smoke else args.arch
    dtype = torch.float32 if args.smoke else torch.bfloat16
    if args.smoke:
        args.batch, args.prompt_len = min(args.batch, 8), min(args.prompt_len, 16)
    model = build_random_model(arch, device, dtype)
    llm = LLM(
        model,
        model_impl=args.model_impl,
        max_model_len=args.prompt_len + 256,
        enforce_eager=args.enforce_eager,
        async_scheduling=(False if args.sync_scheduling else None),
    )
    eng = llm.engine
    sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(EngineRequest([(7 * i + j) % 1000 + 3 for j in range(args.prompt_len)], sp))
    sched = eng.scheduler
    while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
        eng.step()  # prefill until every request is decoding
    for _ in range(3):  # steady state: every request decoding
        eng.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        eng.step()
    if device == "cuda":
        torch.cuda.synchronize()
    log(f"unprofiled: {1e3 * (time.perf_counter() - t0) / args.steps:.2f} ms per decode step")
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(args.steps):
            eng.step()
    os.makedirs(args.out_dir, exist_ok=True)
    trace = os.path.join(args.out_dir, "decode_trace.json")
    prof.export_chrome_trace(trace)
    events = prof.key_averages()
    log(f"{args.steps} decode steps at batch {args.batch}, context ~{args.prompt_len}")
    print(events.table(sort_by="self_cpu_time_total", row_limit=25))
    if device == "cuda":
        print(events.table(sort_by="self_cuda_time_total", row_limit=25))
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        log(f"CUDA kernels per step: {kernels / args.steps:.0f}")
    log(f"wrote {trace}")
    llm.close()


if __name__ == "__main__":
    main()
