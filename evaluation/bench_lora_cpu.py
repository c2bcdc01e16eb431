"""Many LoRA adapters on the CPU: one engine call against stock PEFT's mixed batch, same process.

Workload: 16 prompts (random ids < 1024, lengths U[16, 48], ``random.Random(0)``), 32 new tokens
each (no EOS), greedy; four rank-8 adapters on every projection (``benchmarks/lora.py``), prompt
``i`` under adapter ``i % 4``. Model: a Llama of hidden 256, 4 layers, 8 heads (4 KV heads),
intermediate 768, vocabulary 1024, random fp32 weights.

Systems, each one ``generate`` call on the left-padded batch of 16, timed in ``--repeats`` rounds
that run every system once in turn (the minimum and the median are recorded; the ratios use the
minimum, the run least disturbed by other work on the machine):

* ``stock_mixed``: ``peft_model.generate(..., adapter_names=names)`` (PEFT's per-layer loop
  over each adapter's rows);
* ``paged_mixed``: the same call with ``backend="paged"`` (LoRA slots, one engine call);
* the fast path, every row under adapter 0: ``stock_single`` (PEFT, unmerged),
  ``paged_single_slots`` (the engine's slots, one adapter for the whole step: no grouping) and
  ``paged_single_merged`` (the engine over ``merge_and_unload``'s weights: today's merged path).

Writes ``evaluation/results/lora_cpu.json`` with tokens/s, the ratios and whether every paged row
equals stock's.

``--fast-path``: only the single-adapter systems, per ``--model`` (``tiny``: the model above; a
path: a saved checkpoint, e.g. ``./models/smollm2-135m-instruct`` written by ``hf-paged
fetch-demo-model``) and per ``--ranks`` (adapters made by PEFT from ``LoraConfig(r,
lora_alpha=2r, init_lora_weights=False)`` on every projection, so ``B != 0``), 16 prompts of
U[8, 24] random ids, ``--new`` tokens each. Walls and the process's CPU time per call are recorded (the CPU time is
what other work on a shared machine disturbs least); writes
``evaluation/results/lora_cpu_fast_path.json``.

    OMP_NUM_THREADS=1 PYTHONPATH=. python evaluation/bench_lora_cpu.py
    OMP_NUM_THREADS=1 PYTHONPATH=. python evaluation/bench_lora_cpu.py --fast-path \
        --model tiny --model models/smollm2-135m-instruct --ranks 8 16 --new 48 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

import torch
from results_dir import RESULTS_DIR

from hf_paged.benchmarks.lora import load_peft, save_random_adapter
from hf_paged.benchmarks.run_record import environment, log
from hf_paged.benchmarks.runners import left_pad
from hf_paged.integration.dispatch import release

NUM_PROMPTS, NUM_ADAPTERS, RANK, NEW = 16, 4, 8, 32
# prefix caching off: every timed call repeats the warm-up's prompts, whose KV stock recomputes
ENGINE = dict(max_num_seqs=16, max_loras=NUM_ADAPTERS, max_lora_rank=RANK, kv_block_size=16,
              kv_cache_bytes=64 * 2**20, enable_prefix_caching=False)  # fmt: skip


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=4, intermediate_size=768, vocab_size=1024,
                       max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
                       pad_token_id=0, tie_word_embeddings=False)  # fmt: skip


def _base(config):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _interleaved(systems: dict, repeats: int, cpu: dict | None = None) -> tuple[dict, dict]:
    """Every system warmed up, then ``repeats`` rounds that run each once in turn (a loaded
    machine drifts: interleaving spreads the drift over all systems). Returns
    ``({name: walls}, {name: last output})``; ``cpu``: filled with each call's process CPU time."""
    outs = {name: fn() for name, fn in systems.items()}  # warm-up (engine start, first calls)
    walls = {name: [] for name in systems}
    for _ in range(repeats):
        for name, fn in systems.items():
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] = fn()
            walls[name].append(time.perf_counter() - t0)
            if cpu is not None:
                cpu.setdefault(name, []).append(time.process_time() - c0)
    return walls, outs


def _peft_adapter(base, rank: int, seed: int):
    """PEFT's own LoRA of ``rank`` on every projection, B != 0 (``init_lora_weights=False``)."""
    from peft import LoraConfig, get_peft_model

    from hf_paged.benchmarks.lora import PROJECTIONS

    torch.manual_seed(seed)
    cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJECTIONS),
                     lora_dropout=0.0, init_lora_weights=False)  # fmt: skip
    return get_peft_model(base, cfg).eval()


def _load(model: str):
    """``tiny`` (the random Llama above) or a checkpoint directory, fp32, without EOS."""
    from transformers import AutoModelForCausalLM

    if model == "tiny":
        return _base(_config())
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    m.generation_config.eos_token_id = None  # every row runs all its new tokens
    return m


def _caller(model, call: dict, **kw):
    """``model.generate(**call, **kw)`` as a function of nothing."""
    return lambda: model.generate(**call, **kw)


def fast_path(args) -> None:
    """One adapter for every row: LoRA slots against the engine on merged weights and stock PEFT
    (module docstring)."""
    rows, equal = {}, {}
    for model in args.model:
        vocab = _load(model).config.vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 24))]
                   for _ in range(NUM_PROMPTS)]  # fmt: skip
        ids, mask = left_pad(prompts, "cpu")
        call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=args.new, do_sample=False,
                    pad_token_id=0)  # fmt: skip
        for rank in args.ranks:
            peft_model = _peft_adapter(_load(model), rank, seed=rank)
            merged = _peft_adapter(_load(model), rank, seed=rank).merge_and_unload()
            paged = dict(backend="paged", paged_config=dict(ENGINE, max_lora_rank=rank,
                                                            max_model_len=128))  # fmt: skip
            systems = {
                "stock_peft": _caller(peft_model, call, backend="hf"),
                "paged_slots": _caller(peft_model, call, **paged),
                "paged_merged": _caller(merged, call, **paged),
            }
            cpu: dict = {}
            walls, outs = _interleaved(systems, args.repeats, cpu)
            key = f"{model.rstrip('/').rsplit('/', 1)[-1]}_r{rank}"
            rows[key] = {name: {"wall_min_s": min(ws), "wall_median_s": statistics.median(ws),
                                "cpu_min_s": min(cpu[name]),
                                "cpu_median_s": statistics.median(cpu[name]),
                                "walls_s": ws, "cpu_s": cpu[name]}
                         for name, ws in walls.items()}  # fmt: skip
            r = rows[key]
            for stat in ("wall_min_s", "wall_median_s", "cpu_min_s", "cpu_median_s"):
                r[f"slots_vs_merged_{stat.removesuffix('_s')}"] = (
                    r["paged_slots"][stat] / r["paged_merged"][stat] - 1.0
                )
            equal[key] = {
                name: torch.equal(outs[name], outs["stock_peft"])
                for name in ("paged_slots", "paged_merged")
            }
            log(
                f"{key}: "
                + ", ".join(
                    f"{n} wall min {v['wall_min_s']:.3f} s cpu min {v['cpu_min_s']:.3f} s"
                    for n, v in r.items()
                    if isinstance(v, dict)
                )  # fmt: skip
                + f"; slots vs merged: {100 * r['slots_vs_merged_cpu_min']:+.1f}% (cpu min), "
                f"{100 * r['slots_vs_merged_wall_min']:+.1f}% (wall min); equal {equal[key]}"
            )
            release(peft_model), release(merged)  # their engines' memory, before the next
            del peft_model, merged, systems, outs
    result = {"benchmark": "lora_cpu_fast_path", "prompts": NUM_PROMPTS, "new_tokens": args.new,
              "repeats": args.repeats, "engine_config": ENGINE, "models": args.model,
              "ranks": args.ranks, "systems": rows, "equal_to_stock": equal,
              "env": environment()}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--fast-path", action="store_true", help="only one adapter for every row")
    ap.add_argument("--model", action="append", help="tiny or a checkpoint dir (--fast-path)")
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--new", type=int, default=48)
    args = ap.parse_args()
    import hf_paged  # noqa: F401  (installs the generate dispatcher)

    if args.fast_path:
        args.model = args.model or ["tiny"]
        args.out = args.out or str(RESULTS_DIR / "lora_cpu_fast_path.json")
        fast_path(args)
        return
    args.out = args.out or str(RESULTS_DIR / "lora_cpu.json")

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randint(16, 48))]
               for _ in range(NUM_PROMPTS)]  # fmt: skip
    ids, mask = left_pad(prompts, "cpu")
    names = [f"a{i % NUM_ADAPTERS}" for i in range(NUM_PROMPTS)]
    config = _config()
    tmp = tempfile.mkdtemp()
    dirs = {f"a{i}": save_random_adapter(f"{tmp}/a{i}", config, RANK, seed=i, std=0.05)
            for i in range(NUM_ADAPTERS)}  # fmt: skip
    model = load_peft(_base(config), dirs)
    call = dict(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                pad_token_id=0)  # fmt: skip
    paged = dict(backend="paged", paged_config=ENGINE)
    tokens = NUM_PROMPTS * NEW
    merged = load_peft(_base(config), {"a0": dirs["a0"]}).merge_and_unload()
    mixed = {
        "stock_mixed": lambda: model.generate(**call, adapter_names=names, backend="hf"),
        "paged_mixed": lambda: model.generate(**call, adapter_names=names, **paged),
    }
    single = {  # every row under adapter a0: ``set_adapter`` first
        "stock_single": lambda: model.generate(**call, backend="hf"),
        "paged_single_slots": lambda: model.generate(**call, **paged),
        "paged_single_merged": lambda: merged.generate(**call, **paged),
    }
    walls, outs = _interleaved(mixed, args.repeats)
    model.set_adapter("a0")
    more, more_outs = _interleaved(single, args.repeats)
    walls.update(more)
    outs.update(more_outs)
    rows = {}
    for name, ws in walls.items():  # the minimum: the run least disturbed by other work
        rows[name] = {"wall_s": min(ws), "median_s": statistics.median(ws), "walls_s": ws,
                      "tok_per_s": tokens / min(ws)}  # fmt: skip
        log(f"{name}: min {min(ws):.3f} s, median {statistics.median(ws):.3f} s, "
            f"{tokens / min(ws):.1f} tok/s")  # fmt: skip
    same = {
        "paged_mixed": torch.equal(outs["paged_mixed"], outs["stock_mixed"]),
        "paged_single_slots": torch.equal(outs["paged_single_slots"], outs["stock_single"]),
        "paged_single_merged": torch.equal(outs["paged_single_merged"], outs["stock_single"]),
    }
    result = {
        "benchmark": "lora_cpu", "prompts": NUM_PROMPTS, "adapters": NUM_ADAPTERS, "rank": RANK,
        "new_tokens": NEW, "engine_config": ENGINE, "systems": rows, "equal_to_stock": same,
        "speedup_mixed": rows["stock_mixed"]["wall_s"] / rows["paged_mixed"]["wall_s"],
        "unmerged_cost_single": rows["paged_single_slots"]["wall_s"]
        / rows["paged_single_merged"]["wall_s"] - 1.0,
        "env": environment(),
    }  # fmt: skip
    log(f"mixed: paged {result['speedup_mixed']:.2f}x stock PEFT; single adapter: slots cost "
        f"{100 * result['unmerged_cost_single']:+.1f}% vs merged; equal: {same}")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    log(f"wrote {args.out}")


if __name__ == "__main__":
    main()
