"""Two processes' time breakdowns side by side: a stock run and a paged run of the same client,
each recorded with ``hf-paged run --timings FILE [--backend hf]`` (or ``HF_PAGED_TIMINGS``).

    python evaluation/breakdown.py STOCK.jsonl PAGED.jsonl [--md OUT.md] [--json OUT.json]

Each file holds the JSON lines ``hf_paged/timings.py`` writes (the last line of each is used).
The phases (imports, model load, engine start, client setup, tokenize, model work, adapter,
results, rest) and ``outside model work`` are ``hf_paged/benchmarks/breakdown.py``'s, which says
what each covers; the issue's bar is ours <= stock's + 1 s outside model work.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from hf_paged.benchmarks.breakdown import last_record, side_by_side


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("stock")
    ap.add_argument("paged")
    ap.add_argument("--md", help="also write the table to this file")
    ap.add_argument("--json", help="also write both phase dicts to this file")
    args = ap.parse_args()
    both = side_by_side(last_record(args.stock), last_record(args.paged))
    print(both["table"])
    if args.md:
        Path(args.md).write_text(both["table"] + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"stock": both["stock"], "paged": both["paged"]},
                                              indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
