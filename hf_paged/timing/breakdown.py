"""Two processes' time breakdowns side by side: a stock run and a paged run of the same client,
each recorded with ``hf-paged run --timings FILE [--backend hf]`` (or ``HF_PAGED_TIMINGS``).
``python -m hf_paged.timing.breakdown STOCK.jsonl PAGED.jsonl`` (or ``evaluation/breakdown.py``)
tables two record files; the client suite (``CLIENTS_BREAKDOWN=1``) tables each client's pair.

Phases, in seconds (``client.py`` says what each span covers):

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

``outside model work`` is the wall time less the model work; the bar the client benchmarks hold
it to is ours <= stock's + ``SLACK_S``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PHASES = ("imports", "model load", "engine start", "client setup", "tokenize", "model work",
          "adapter", "results", "rest")  # fmt: skip
SLACK_S = 1.0  # the bar: ours outside model work <= stock's + 1 s


def _span(record: dict, name: str) -> float:
    return float(record["spans"].get(name, {}).get("total_s", 0.0))


def phases(record: dict) -> dict[str, float]:
    """The phases of one process's record (``spans.snapshot()``), seconds."""
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
    """A markdown table of two ``phases`` dicts: each phase, stock, paged and paged - stock."""
    rows = ["| phase | stock (s) | paged (s) | paged - stock (s) |", "|---|---|---|---|"]
    for name in (*PHASES, "outside model work", "wall"):
        s, p = stock.get(name, 0.0), paged.get(name, 0.0)
        rows.append(f"| {name} | {s:.2f} | {p:.2f} | {p - s:+.2f} |")
    return "\n".join(rows)


def side_by_side(stock_record: dict, paged_record: dict) -> dict:
    """Two records' phases, their table and the acceptance's figure.

    Returns:
        ``{"stock": phases, "paged": phases, "table": markdown,
        "outside_model_work_diff_s": paged's outside model work - stock's,
        "within_slack": that difference <= SLACK_S}``.
    """
    stock, paged = phases(stock_record), phases(paged_record)
    diff = paged["outside model work"] - stock["outside model work"]
    return {"stock": stock, "paged": paged, "table": table(stock, paged),
            "outside_model_work_diff_s": diff, "within_slack": diff <= SLACK_S}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """``STOCK.jsonl PAGED.jsonl [--md OUT.md] [--json OUT.json]``: print the table of the last
    record of each file, and write it (``--md``) and both phase dicts (``--json``)."""
    ap = argparse.ArgumentParser(description="two processes' time breakdowns side by side")
    ap.add_argument(
        "stock", help="the stock run's record file (hf-paged run --timings F --backend hf)"
    )
    ap.add_argument("paged", help="the paged run's record file (hf-paged run --timings F)")
    ap.add_argument("--md", help="also write the table to this file")
    ap.add_argument("--json", help="also write both phase dicts to this file")
    args = ap.parse_args(argv)
    both = side_by_side(last_record(args.stock), last_record(args.paged))
    print(both["table"])
    if args.md:
        Path(args.md).write_text(both["table"] + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stock": both["stock"], "paged": both["paged"]},
                                              indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
