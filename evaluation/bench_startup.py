"""Start-up wall time of the light entry points, each in a fresh process: ``import hf_paged``,
``hf-paged --help``, and, for scale, ``import torch`` and ``import transformers`` alone.

    PYTHONPATH=. .venv/bin/python evaluation/bench_startup.py [--repeats 5] [--out FILE]

Prints the median and best of ``--repeats`` runs per entry point and writes them, with the git
sha and the load average, to ``evaluation/results/startup_<UTC>.json`` (or ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENTRIES = {
    "import hf_paged": ["-c", "import hf_paged"],
    "hf-paged --help": ["-m", "hf_paged.entrypoints.cli", "--help"],
    "import torch": ["-c", "import torch"],
    "import transformers": ["-c", "import transformers.generation.utils"],
}


def _time(args: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], cwd=ROOT, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args()
    for argv in ENTRIES.values():  # warm the file cache once
        _time(argv)
    rows = {}
    for name, argv in ENTRIES.items():
        times = [_time(argv) for _ in range(args.repeats)]
        rows[name] = {"median_s": round(statistics.median(times), 3), "best_s": round(min(times), 3)}
        print(f"{name:<22} median {rows[name]['median_s']:.3f} s  best {rows[name]['best_s']:.3f} s")
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()  # fmt: skip
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out or ROOT / "evaluation" / "results" / f"startup_{stamp}.json")
    out.write_text(json.dumps({"benchmark": "startup", "git_sha": sha, "repeats": args.repeats,
                               "load_average": os.getloadavg(), "python": sys.version.split()[0],
                               "results": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
