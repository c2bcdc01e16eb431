"""Two processes' time breakdowns side by side: a stock run and a paged run of the same client,
each recorded with ``hf-paged run --timings FILE [--backend hf]`` (or ``HF_PAGED_TIMINGS``).

    python evaluation/breakdown.py STOCK.jsonl PAGED.jsonl [--md OUT.md] [--json OUT.json]

Each file holds the JSON lines ``hf_paged/timings.py`` writes (the last line of each is used).
Phases, in seconds (``hf_paged/integration/client_timings.py`` says what each span covers):

    imports        process start to torch and transformers imported
    model load     transformers' from_pretrained
    engine start   building the engine (warm-up compiles, KV cache, CUDA graphs): paged only
    client setup   lm-eval's task index and request building
    tokenize       the client's tokenizer calls
    model work     stock: HFLM._model_call / _model_generate, the pipeline's _forward, generate;
                   paged: the engine's steps
    adapter        the request phase less its tokenization and model work: for paged, our
                   adapters' host work (request building, waits, results); for stock, the
                   client's own loop around the model
    results        lm-eval's process_results and result files; the pipeline's postprocess
    rest           wall time in none of the above (interpreter start-up after imports, the
                   client's own code, exit)

``outside model work`` is the wall time less the model work: the issue's bar is ours <= stock's
+ 1 s there.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("imports", "model load", "engine start", "client setup", "tokenize", "model work",
          "adapter", "results", "rest")  # fmt: skip


def _span(record: dict, name: str) -> float:
    return float(record["spans"].get(name, {}).get("total_s", 0.0))


def phases(record: dict) -> dict[str, float]:
    """The phases of one process's record (``timings.snapshot()``), seconds."""
    wall = float(record.get("wall_s") or record.get("uptime_s") or 0.0)
    paged = "engine.step_total" in record["spans"] or "engine_start" in record["spans"]
    model = _span(record, "engine.step_total") if paged else _span(record, "model.stock")
    if paged:  # a stock call inside a paged process (a named fallback) is model work too
        model += _span(record, "model.stock")
    requests = _span(record, "client.requests")
    tokenize = _span(record, "client.tokenize")
    out = {
        "imports": float(record.get("imports_s") or 0.0),
        "model load": _span(record, "hf.from_pretrained"),
        "engine start": _span(record, "engine_start"),
        "client setup": _span(record, "client.setup"),
        "tokenize": tokenize,
        "model work": model,
        # tokenization and model work inside the request phase; an engine start there too
        "adapter": max(0.0, requests - min(requests, tokenize + model
                                           + _span(record, "engine_start"))),
        "results": _span(record, "client.results"),
    }  # fmt: skip
    out["rest"] = max(0.0, wall - sum(out.values()))
    out["wall"] = wall
    out["outside model work"] = wall - model
    return out


def last_record(path: str | Path) -> dict:
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: no timing record (was HF_PAGED_TIMINGS set for that run?)")
    return json.loads(lines[-1])


def table(stock: dict[str, float], paged: dict[str, float]) -> str:
    rows = ["| phase | stock (s) | paged (s) | paged - stock (s) |", "|---|---|---|---|"]
    for name in (*PHASES, "outside model work", "wall"):
        s, p = stock.get(name, 0.0), paged.get(name, 0.0)
        rows.append(f"| {name} | {s:.2f} | {p:.2f} | {p - s:+.2f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stock")
    ap.add_argument("paged")
    ap.add_argument("--md", help="also write the table to this file")
    ap.add_argument("--json", help="also write both phase dicts to this file")
    args = ap.parse_args()
    stock, paged = phases(last_record(args.stock)), phases(last_record(args.paged))
    text = table(stock, paged)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stock": stock, "paged": paged}, indent=1))


if __name__ == "__main__":
    main()
