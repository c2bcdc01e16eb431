"""Many LoRA adapters on one GPU: ``LLM`` with ``lora_request`` against the same requests on one
merged adapter and against stock PEFT ``generate(adapter_names=...)``.

Workload: W2's 256 requests (prompts U[100, 1024], outputs U[100, 1024] tokens, random ids,
seed 0, EOS ignored, greedy) on the Llama-3-8B shape with random bf16 weights
(``random_models.build_random_model``). Eight rank-16 adapters on every projection
(``benchmarks/lora.save_random_adapter``, written as PEFT writes them); request ``i`` gets one of
the eight or ``"__base__"`` uniformly (``benchmarks/lora.assign``, seed 0).

Systems, in this order, one model in memory:

* ``stock_peft``: stock PEFT (the eight adapters loaded with ``PeftModel`` /
  ``load_adapter``), ``generate(adapter_names=...)`` in left-padded batches of 64 with per-row
  lengths, on the first ``--stock-requests`` requests (default 64: one batch; stock's rate is
  the same per batch);
* ``llm_lora``: ``LLM(model, enable_lora=True, max_loras=8, max_lora_rank=16)`` and
  ``generate(prompts, params, lora_request=[LoRARequest per request or None])``, all 256;
* ``llm_single_slots``: the same LoRA engine with every request under adapter 0 (the
  single-adapter case on slots: unmerged, decode in CUDA graphs);
* ``llm_merged``: adapter 0 merged into the weights (``W += scale * B @ A``), ``LLM(model)``
  without LoRA, all 256 (the price of one merged adapter; its outputs differ by design).

Metric: requested output tokens / wall time; each engine's ``decode_graphs`` says whether its
decode steps were captured (else the reason). Also: greedy agreement of ``llm_lora`` with
``stock_peft`` on the stock subset (bf16: rows may part where logits nearly tie). JSON goes to
``$OUT`` when set (the device tool), else ``evaluation/results/lora_gpu_<stamp>.json``.

    PYTHONUNBUFFERED=1 PYTHONPATH=. python evaluation/bench_lora_gpu.py          # H200
    PYTHONPATH=. python evaluation/bench_lora_gpu.py --requests 96 --stock-requests 0  # ~4 min
    PYTHONPATH=. python evaluation/bench_lora_gpu.py --tiny                       # CPU, tiny
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.device_memory import free_memory, sync
from hf_paged.benchmarks.lora import assign, load_peft, save_random_adapter
from hf_paged.benchmarks.random_models import build_random_model, model_config
from hf_paged.benchmarks.run_record import environment, log, utc_stamp
from hf_paged.benchmarks.runners import PerRowLength, agreement, left_pad
from hf_paged.benchmarks.workloads import Workload, get_workload

NUM_ADAPTERS, BASE = 8, "__base__"


def run_stock_peft(peft_model, wl: Workload, names: list[str], batch: int, device) -> dict:
    """Stock PEFT mixed batches (``adapter_names`` per row), per-row lengths."""
    from transformers import StoppingCriteriaList

    def one(prompts, lens, rows):
        ids, mask = left_pad(prompts, device)
        crit = StoppingCriteriaList([PerRowLength(ids.shape[1], lens, device)])
        seqs = peft_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(lens),
                                   do_sample=False, pad_token_id=0, stopping_criteria=crit,
                                   adapter_names=rows, backend="hf")  # fmt: skip
        return [r[:n] for r, n in zip(seqs[:, ids.shape[1] :].tolist(), lens)]

    one([[1, 2, 3, 4], [5, 6]], [2, 2], names[:2])  # warm-up
    sync(device)
    t0, outputs = time.perf_counter(), []
    for s in range(0, wl.num_requests, batch):
        outputs += one(wl.prompts[s : s + batch], wl.output_lens[s : s + batch],
                       names[s : s + batch])  # fmt: skip
        log(f"  stock batch {s // batch} done")
    sync(device)
    return _row("stock_peft", wl, time.perf_counter() - t0, outputs, batch_size=batch)


def run_llm(model, wl: Workload, engine: dict, requests=None, system: str = "llm_lora") -> dict:
    from hf_paged import LLM, SamplingParams

    free_memory(model.device)
    t = time.perf_counter()
    llm = LLM(model, **engine)
    startup = time.perf_counter() - t
    reason = llm.engine.executor.runner.cuda_graph_reason
    graphs = "captured" if reason is None and model.device.type == "cuda" else reason
    log(f"{system}: decode graphs {graphs}")
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        warm_lora = None if requests is None else [requests[0], None]
        llm.generate([[1, 2, 3, 4], [5, 6]], warm, use_tqdm=False, lora_request=warm_lora)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in wl.output_lens]  # fmt: skip
        sync(model.device)
        t0 = time.perf_counter()
        outs = llm.generate(wl.prompts, params, use_tqdm=False, lora_request=requests)
        sync(model.device)
        wall = time.perf_counter() - t0
        stats = llm.stats
    finally:
        llm.close()
        del llm
        free_memory(model.device)
    return _row(system, wl, wall, [list(o.outputs[0].token_ids) for o in outs],
                startup_s=startup, num_preemptions=stats.get("num_preemptions"),
                engine_config=engine, decode_graphs=graphs)  # fmt: skip


def _row(system, wl: Workload, wall: float, outputs, **extra) -> dict:
    tokens = wl.num_output_tokens
    log(f"{system}: {wl.num_requests} requests, {tokens} tokens, {wall:.2f} s, "
        f"{tokens / wall:.1f} tok/s")  # fmt: skip
    return {"system": system, "requests": wl.num_requests, "output_tokens": tokens,
            "wall_s": wall, "tok_per_s": tokens / wall, "outputs": outputs, **extra}  # fmt: skip


@torch.no_grad()
def merge_into(model, adapter_dir: str) -> None:
    """``W += scale * B @ A`` for every module of a saved adapter (in place)."""
    from hf_paged.models.adapters import load_adapter_dir

    adapter = load_adapter_dir("merged", adapter_dir)
    for name, f in adapter.layers.items():
        w = model.get_submodule(name).weight
        w += (f.scale * (f.b.to(w.device, torch.float32) @ f.a.to(w.device, torch.float32))
              ).to(w.dtype)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a smoke run)")
    ap.add_argument("--stock-requests", type=int, default=64, help="0: no stock PEFT run")
    ap.add_argument("--requests", type=int, help="the first N of W2's requests (default all)")
    ap.add_argument("--batch-size", type=int, default=64)
    args = ap.parse_args()
    import hf_paged  # noqa: F401  (installs the generate dispatcher)
    from hf_paged import LoRARequest

    if args.tiny:
        arch, device, dtype, rank = "tiny", "cpu", torch.float32, 4
        wl = get_workload("W2", smoke=True)
        prompts, lens = wl.prompts * 2, wl.output_lens * 2  # 16 requests
        wl = Workload(wl.name, "tiny", prompts, lens)
        engine = dict(kv_cache_bytes=64 * 2**20, max_num_seqs=16)
        batch, stock_n = 8, 8
    else:
        arch, device, dtype, rank = "llama3-8b", "cuda", torch.bfloat16, 16
        wl = get_workload("W2")
        if args.requests:
            wl = wl.head(args.requests)
        engine = {}
        batch, stock_n = args.batch_size, args.stock_requests
    adapters = [f"lora{i}" for i in range(NUM_ADAPTERS)]
    names = assign(wl.num_requests, adapters + [BASE])
    config = model_config(arch)
    tmp = tempfile.mkdtemp(prefix="lora_bench_")
    dirs = {n: save_random_adapter(f"{tmp}/{n}", config, rank, seed=i, dtype=dtype)
            for i, n in enumerate(adapters)}  # fmt: skip
    log(f"{NUM_ADAPTERS} adapters of rank {rank} written to {tmp}")
    model = build_random_model(arch, device=device, dtype=dtype)

    rows = []
    if stock_n:
        peft_model = load_peft(model, dirs)
        rows.append(run_stock_peft(peft_model, wl.head(stock_n), names[:stock_n], batch, device))
        model = peft_model.unload()  # the plain model again (no merge)
        del peft_model
        free_memory(device)
    ids = {n: i + 1 for i, n in enumerate(adapters)}
    requests = [None if n == BASE else LoRARequest(n, ids[n], dirs[n]) for n in names]
    lora_engine = dict(engine, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=rank)
    rows.append(run_llm(model, wl, lora_engine, requests))
    single = [LoRARequest(adapters[0], ids[adapters[0]], dirs[adapters[0]])] * wl.num_requests
    rows.append(run_llm(model, wl, lora_engine, single, system="llm_single_slots"))
    merge_into(model, dirs[adapters[0]])
    rows.append(run_llm(model, wl, engine, None, system="llm_merged"))

    stock = rows[0] if stock_n else None
    lora, single, merged = rows[-3], rows[-2], rows[-1]
    result = {
        "benchmark": "lora_gpu",
        "arch": arch,
        "dtype": str(dtype),
        "adapters": NUM_ADAPTERS,
        "rank": rank,
        "assignment": {n: names.count(n) for n in adapters + [BASE]},
        "systems": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
        "llm_lora_vs_stock_peft": lora["tok_per_s"] / stock["tok_per_s"] if stock else None,
        "llm_lora_vs_llm_merged": lora["tok_per_s"] / merged["tok_per_s"],
        "llm_single_slots_vs_llm_merged": single["tok_per_s"] / merged["tok_per_s"],
        "agreement_llm_lora_vs_stock_peft": (
            agreement(stock["outputs"], lora["outputs"][:stock_n]) if stock else None
        ),
        "env": environment(),
    }
    log(
        f"llm_lora {result['llm_lora_vs_llm_merged']:.2f}x one merged adapter, one adapter on "
        f"slots {result['llm_single_slots_vs_llm_merged']:.2f}x; llm_lora vs stock PEFT: "
        f"{result['llm_lora_vs_stock_peft']}; agreement {result['agreement_llm_lora_vs_stock_peft']}"
    )
    out_dir = Path(os.environ.get("OUT") or RESULTS_DIR)
    path = out_dir / f"lora_gpu{'_tiny' if args.tiny else ''}_{utc_stamp()}.json"
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
