"""Engine start, build to the first token: ``LLM(checkpoint)`` at its defaults (max_model_len
from the checkpoint, gpu_memory_utilization 0.9), then one one-token request. Run with a fresh
``TRITON_CACHE_DIR`` (cold: every kernel compiles) and again with the same one (warm). Writes
the times and the engine's start steps (``HF_PAGED_TIMINGS`` spans)."""

from __future__ import annotations

import time

T0 = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    from hf_paged import LLM, SamplingParams
    from hf_paged.timing import spans

    imported = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype)
    built = time.perf_counter()
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=1),
                       use_tqdm=False)  # fmt: skip
    first = time.perf_counter()
    assert len(out[0].outputs[0].token_ids) == 1
    doc = {"import_s": imported - T0, "build_s": built - imported,
           "build_to_first_token_s": first - imported, "first_request_s": first - built,
           "num_kv_blocks": llm.stats["num_kv_blocks"],
           "cuda_graphs": llm.engine.executor.runner.graph_runner is not None,
           "spans": spans.snapshot()["spans"]}  # fmt: skip
    llm.close()
    with open(args.out, "w") as f:
        json.dump(doc, f)


if __name__ == "__main__":
    main()
