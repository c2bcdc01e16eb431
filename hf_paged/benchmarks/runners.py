"""The systems the benchmarks time on one request set (``workloads.Workload``), all greedy with
EOS ignored, each request exactly its own number of new tokens: stock ``generate`` on left-padded
batches, transformers' own continuous batching, ``hf_paged.LLM`` and the ``generate``
dispatcher; and the greedy-token agreement of two systems' outputs.

Each ``run_*`` returns one result row (a dict: ``system``, ``wall_s``, ``tok_per_s``, the
``outputs`` ...) for ``evaluation/`` scripts and ``hf-paged bench``. The engine is reached through
the public API (``from hf_paged import LLM``), as a user's script reaches it.
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from hf_paged.benchmarks.device_memory import free_memory, sync
from hf_paged.benchmarks.run_record import TritonCompileLog, log
from hf_paged.benchmarks.workloads import Workload

SYSTEMS = ("stock", "cb", "llm", "dispatch")
LABELS = {
    "stock": "HF generate (sdpa, padded batches)",
    "cb": "transformers CB (paged|sdpa)",
    "llm": "hf_paged LLM",
    "llm_subset": "hf_paged LLM (baseline subset)",
    "dispatch": 'hf_paged generate(backend="paged")',
}


class PerRowLength(StoppingCriteria):
    """Row i is done once it has ``lens[i]`` new tokens past the padded prompt width."""

    def __init__(self, prompt_width: int, lens: list[int], device):
        self.prompt_width = prompt_width
        self.lens = torch.tensor(lens, device=device)  # [B]

    def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
        return (input_ids.shape[1] - self.prompt_width) >= self.lens  # [B]


def left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` [B, L], pads (id 0) on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids.to(device), mask.to(device)


def _result(system: str, wl: Workload, wall: float, outputs: list[list[int]], **extra) -> dict:
    got = [len(o) for o in outputs]
    short = [i for i, (g, w) in enumerate(zip(got, wl.output_lens)) if g < w]
    if short:
        raise RuntimeError(f"{system}: requests {short[:8]} got fewer tokens than requested")
    tokens = wl.num_output_tokens
    log(f"{system}: {wl.num_requests} requests, {tokens} tokens, {wall:.2f} s, "
        f"{tokens / wall:.1f} tok/s")  # fmt: skip
    return {
        "system": system, "label": LABELS[system], "requests": wl.num_requests,
        "prompt_tokens": wl.num_prompt_tokens, "output_tokens": tokens, "wall_s": wall,
        "tok_per_s": tokens / wall, "outputs": [o[:w] for o, w in zip(outputs, wl.output_lens)],
        **extra,
    }  # fmt: skip


# ---- systems ----------------------------------------------------------------------------------


def _dispatcher_installed() -> bool:
    try:
        from hf_paged.integration.dispatch import is_installed
    except Exception:  # noqa: BLE001 - no dispatcher: plain stock generate
        return False
    return is_installed()


def generate_batches(model, wl: Workload, batch_size: int, device, **kwargs) -> list[list[int]]:
    """``wl`` through ``model.generate`` in left-padded batches with per-row stopping."""
    if "backend" not in kwargs and _dispatcher_installed():
        kwargs["backend"] = "hf"  # stock rows stay stock whatever HF_PAGED_BACKEND says
    outputs = []
    for start in range(0, wl.num_requests, batch_size):
        prompts = wl.prompts[start : start + batch_size]
        lens = wl.output_lens[start : start + batch_size]
        ids, mask = left_pad(prompts, device)
        crit = PerRowLength(ids.shape[1], lens, device)
        seqs = model.generate(
            ids, attention_mask=mask, max_new_tokens=max(lens), do_sample=False,
            pad_token_id=0, stopping_criteria=StoppingCriteriaList([crit]), **kwargs,
        )  # fmt: skip
        new = seqs[:, ids.shape[1] :].tolist()
        outputs += [row[:n] for row, n in zip(new, lens)]
        log(f"  batch {start // batch_size}: {len(prompts)} rows, width {ids.shape[1]}, "
            f"{max(lens)} steps done")  # fmt: skip
    return outputs


def run_stock(model, wl: Workload, batch_size: int, device) -> dict:
    warm = Workload("warmup", wl.arch, [[1, 2, 3, 4], [5, 6]], [4, 2])
    generate_batches(model, warm, 2, device)
    sync(device)
    t0 = time.perf_counter()
    outputs = generate_batches(model, wl, batch_size, device)
    sync(device)
    return _result("stock", wl, time.perf_counter() - t0, outputs, batch_size=batch_size)


def run_cb(model, wl: Workload, device) -> dict:
    from transformers import GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(
        do_sample=False, max_new_tokens=max(wl.output_lens), eos_token_id=-1, pad_token_id=0
    )
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in wl.prompts),
        max_generated_length=max(wl.output_lens),
        num_requests=wl.num_requests,
    )
    model.set_attn_implementation("paged|sdpa")
    try:
        t_start = time.perf_counter()
        with model.continuous_batching_context_manager(
            generation_config=gen, block=True, timeout=30, workload_hints=hints
        ) as manager:  # its warm-up (CUDA graphs) runs before this block: not timed
            startup = time.perf_counter() - t_start
            log(f"cb: manager ready in {startup:.1f} s")
            sync(device)
            t0 = time.perf_counter()
            rids = [
                manager.add_request(p, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
                for i, (p, n) in enumerate(zip(wl.prompts, wl.output_lens))
            ]
            results, last_log = {}, t0
            while len(results) < len(rids):
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("transformers CB: generation thread died")
                elif r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"transformers CB: request {r.request_id}: {r.error}")
                    results[r.request_id] = r
                if time.perf_counter() - last_log > 15:
                    last_log = time.perf_counter()
                    log(f"  cb: {len(results)}/{len(rids)} requests done")
            sync(device)
            wall = time.perf_counter() - t0
    finally:
        model.set_attn_implementation("sdpa")
    outputs = [list(results[r].generated_tokens) for r in rids]
    return _result("cb", wl, wall, outputs, startup_s=startup,
                   cb_config=str(getattr(manager, "continuous_batching_config", None)))  # fmt: skip


def run_llm(source, wl: Workload, engine_kwargs: dict, device, system: str = "llm") -> dict:
    """``wl`` through ``hf_paged.LLM(source)``: ``source`` is the HF model or, at
    tensor_parallel_size > 1, a checkpoint directory of it (``random_models.engine_source``)."""
    from hf_paged import LLM, SamplingParams

    free_memory(device)
    t_start = time.perf_counter()
    llm = LLM(source, **engine_kwargs)
    startup = time.perf_counter() - t_start
    log(f"{system}: engine ready in {startup:.1f} s ({llm.stats['num_kv_blocks']} KV blocks)")
    try:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([[1, 2, 3, 4], [5, 6]], warm, use_tqdm=False)
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in wl.output_lens
        ]
        stats0 = llm.stats
        sync(device)
        t0 = time.perf_counter()
        with TritonCompileLog() as compiles:
            outs = llm.generate(wl.prompts, params, use_tqdm=False)
            sync(device)
        wall = time.perf_counter() - t0
        stats = llm.stats
        info = {
            "startup_s": startup,
            "device": str(llm.engine.runtime.device),
            "dtype": str(llm.engine.runtime.dtype),
            "engine_config": dataclasses.asdict(llm.engine.config),
            "num_kv_blocks": stats["num_kv_blocks"],
            "num_preemptions": stats["num_preemptions"] - stats0["num_preemptions"],
            "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"]
            - stats0["prefix_cache_hit_tokens"],
            "profile": stats.get("profile"),  # HF_PAGED_PROFILE=1: host/GPU split per step
            "triton_compiles_in_run": compiles.summary(),
            "attention_backend": type(
                getattr(getattr(llm.engine.executor, "runner", None), "attn_backend", None)
            ).__name__,
        }
    finally:
        llm.close()
        del llm
        free_memory(device)
    tc = info["triton_compiles_in_run"]
    log(f"{system}: {tc['count']} Triton compiles in the timed run ({tc['total_s']:.2f} s)")
    for line in tc["kernels"]:
        log(f"  compiled: {line}")
    if info["profile"]:
        for name, row in info["profile"].items():
            log(
                f"{system} profile {name:>15}: {row['total_s']:7.3f} s, {row['mean_ms']:7.3f} ms x {row['calls']}"
            )
    outputs = [list(o.outputs[0].token_ids) for o in outs]
    row = _result(system, wl, wall, outputs, **info)
    if engine_kwargs.get("tensor_parallel_size", 1) > 1:
        row["label"] += f" tp={engine_kwargs['tensor_parallel_size']}"
    return row


def run_dispatch(model, wl: Workload, batch_size: int, device, engine_kwargs: dict) -> dict:
    try:
        from hf_paged import PagedFallbackWarning, install, release
    except Exception as e:  # noqa: BLE001 - the row is optional
        log(f"dispatch: skipped, the dispatcher does not import: {e!r}")
        return {"system": "dispatch", "label": LABELS["dispatch"], "skipped": repr(e)}
    install()
    kwargs = {"backend": "paged", "paged_config": engine_kwargs}
    free_memory(device)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", PagedFallbackWarning)
            t_start = time.perf_counter()
            warm = Workload("warmup", wl.arch, [[1, 2, 3, 4], [5, 6]], [4, 2])
            generate_batches(model, warm, 2, device, **kwargs)  # builds the engine
            log(f"dispatch: engine ready + warm-up in {time.perf_counter() - t_start:.1f} s")
            sync(device)
            t0 = time.perf_counter()
            outputs = generate_batches(model, wl, batch_size, device, **kwargs)
            sync(device)
            wall = time.perf_counter() - t0
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, PagedFallbackWarning)]
    finally:
        release(model)
        free_memory(device)
    if fallbacks:
        log(f"dispatch: FELL BACK to stock generate: {fallbacks}")
    return _result("dispatch", wl, wall, outputs, batch_size=batch_size,
                   fell_back_to_stock=fallbacks)  # fmt: skip


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """Greedy-token agreement of ``other`` with ``reference`` (same requests, same lengths)."""
    prefixes, equal, total = [], 0, 0
    for ref, oth in zip(reference, other):
        n = 0
        while n < len(ref) and n < len(oth) and ref[n] == oth[n]:
            n += 1
        prefixes.append(n)
        equal += sum(a == b for a, b in zip(ref, oth))
        total += len(ref)
    return {
        "requests": len(prefixes),
        "prefix_agreement_rate": sum(prefixes) / total,  # positions before the first divergence
        "mean_exact_prefix_len": sum(prefixes) / len(prefixes),
        "mean_output_len": total / len(prefixes),
        "exact_match_requests": sum(p == len(r) for p, r in zip(prefixes, reference)),
        "position_agreement_rate": equal / total,  # all positions, after divergence too
    }
