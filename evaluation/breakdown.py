"""Two processes' time breakdowns side by side: a stock run and a paged run of the same client,
each recorded with ``hf-paged run --timings FILE [--backend hf]`` (or ``HF_PAGED_TIMINGS``).

    python evaluation/breakdown.py STOCK.jsonl PAGED.jsonl [--md OUT.md] [--json OUT.json]

Each file holds the JSON lines of ``hf_paged/timing/spans.py`` (the last line of each is used).
The phases, what each covers and the table are ``hf_paged/timing/breakdown.py``'s (this script
is its command line, ``python -m hf_paged.timing.breakdown`` the same); the bar is ours <= stock's
+ 1 s outside model work.
"""

from __future__ import annotations

from hf_paged.timing.breakdown import main

if __name__ == "__main__":
    main()
