"""The GPU tests (marker ``gpu``) in parts of under 8 minutes each on one H200: the one place
that says which test folders and files each part runs.

``make test-gpu PART=k`` (``tools/test-gpu.sh k``) runs ``python3 tests/gpu_parts.py run k`` on
the GPU machine; no part runs them all, one after another. A part is a list of test folders or
files; a path that does not exist in this checkout is skipped with a message (the test tree is
being reorganised: old and new folder names are both listed), and the last part takes every
top-level test folder that no other part names, so a new folder is never left out. Each run
writes into ``$OUT`` (default ``evaluation/results``): the pytest log, a JUnit XML with every
test's time, and a JSON summary (part, paths, wall time, exit status, pytest's last line).

    python3 tests/gpu_parts.py list          # the parts as a Markdown table (README)
    python3 tests/gpu_parts.py paths 3       # what part 3 passes to pytest
    python3 tests/gpu_parts.py run 3 [-x]    # run it (extra arguments go to pytest)

No torch and no test imports here: it runs before anything is installed.
"""

from __future__ import annotations

import datetime
import importlib.util
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOT_GPU = ("tests/clients",)  # the client suite has its own runner (make test-gpu-clients)


@dataclass(frozen=True)
class Part:
    number: int
    covers: str  # what the part tests, for the README
    paths: tuple[str, ...]  # folders or files, relative to the project root
    ignore: tuple[str, ...] = ()  # inside ``paths``, run by another part
    estimate_s: int = 0  # on one H200, cold Triton cache (see the README for measured times)
    rest: bool = False  # also every top-level test folder no other part names
    may_be_empty: bool = False  # "no tests selected" is a pass
    workers: int = 0  # pytest-xdist processes where it is installed (tests with fixed KV sizes:
    # an engine sized from its share of the device would refuse beside another)


KERNELS_MAIN = ("tests/kernels/test_paged_attention.py",)
COVERAGE = ("tests/models/test_coverage.py",)

PARTS = (
    Part(1, "engine: runner and CUDA graphs, scheduler, KV memory budget (10 rebuilds, two "
            "engines at 0.45), spec decoding, prompt logprobs, sampler, switches",
         ("tests/engine", "tests/test_envs.py", "tests/layers", "tests/attention"),
         ignore=("tests/engine/worker/tp",), estimate_s=240),
    Part(2, "front ends: beam search on CUDA, PEFT adapters, pipeline streaming, stock calls "
            "beside an engine (8B shape, ~20 GB of beam-search activations)",
         ("tests/integration", "tests/entrypoints", "tests/reliability", "tests/benchmarks"),
         estimate_s=200),
    Part(3, "Triton attention kernels against their torch references (prefill, decode, "
            "split-K, softcap/ALiBi/sinks/MLA, CUDA graphs): ~110 tests, Triton compiles "
            "for each",
         KERNELS_MAIN, estimate_s=120, workers=8),
    Part(4, "the other kernels: fused norms/rope/activations (~400 cases), skinny GEMM, FP8 "
            "GEMM and the tiny FP8 checkpoint, PDL",
         ("tests/kernels",), ignore=KERNELS_MAIN, estimate_s=90, workers=8),
    Part(5, "models: generic path, adapters, toy-model protocol, the hybrid and SSM families "
            "on CUDA (decode graphs, cramped engines)",
         ("tests/models",), ignore=COVERAGE, estimate_s=300),
    Part(6, "the CUDA coverage run over ~150 architectures (fp32, served vs stock), in 4 shards "
            "side by side",
         COVERAGE, estimate_s=300, workers=4),
    Part(7, "every other test folder (tp's tests are multi_gpu: none selected by -m gpu)",
         ("tests/engine/worker/tp",), rest=True, may_be_empty=True, estimate_s=30),
)  # fmt: skip


def part(number: int) -> Part:
    for p in PARTS:
        if p.number == number:
            return p
    raise ValueError(f"PART={number!r} is not allowed: must be one of {[p.number for p in PARTS]}")


def _named_tops() -> set[str]:
    """The top-level test folders some part names (``tests/x`` of ``tests/x/y.py`` too)."""
    return {"/".join(Path(path).parts[:2]) for p in PARTS for path in p.paths} | set(NOT_GPU)


@dataclass
class Resolved:
    paths: list[str] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # named but not in this checkout


def resolve(p: Part, root: Path = ROOT) -> Resolved:
    """The paths of ``p`` that exist under ``root``; for the ``rest`` part, every top-level test
    folder that no part names as well."""
    out = Resolved()
    paths = list(p.paths)
    if p.rest:
        named = _named_tops()
        paths += sorted(
            f"tests/{d.name}" for d in (root / "tests").iterdir()
            if d.is_dir() and not d.name.startswith((".", "_")) and f"tests/{d.name}" not in named
        )  # fmt: skip
    for path in paths:
        (out.paths if (root / path).exists() else out.skipped).append(path)
    out.ignore = [path for path in p.ignore if (root / path).exists()]
    return out


def pytest_args(p: Part, root: Path = ROOT) -> list[str]:
    r = resolve(p, root)
    return ["-m", "gpu", *r.paths, *(f"--ignore={path}" for path in r.ignore)]


def xdist_args(p: Part) -> list[str]:
    """``-n K`` for a part that runs side by side, where pytest-xdist is installed (make
    gpu-wheels carries it); nothing otherwise (the part then runs in one process, slower)."""
    if not p.workers:
        return []
    if importlib.util.find_spec("xdist") is None:
        print(f"gpu_parts: part {p.number}: pytest-xdist is not installed, one process", flush=True)
        return []
    return ["-n", str(p.workers)]


def markdown() -> str:
    rows = ["| part | covers | folders / files | estimate |", "|---|---|---|---|"]
    for p in PARTS:
        where = ", ".join(f"`{x}`" for x in p.paths)
        if p.ignore:
            where += " without " + ", ".join(f"`{x}`" for x in p.ignore)
        if p.rest:
            where += " + any folder no part names"
        est = "< 1 min" if p.estimate_s < 60 else f"~{p.estimate_s / 60:.0f} min"
        rows.append(f"| {p.number} | {p.covers} | {where} | {est} |")
    return "\n".join(rows)


def run(p: Part, extra: list[str], out_dir: Path) -> int:
    """pytest over part ``p`` in a subprocess; log, JUnit XML and a JSON summary in ``out_dir``."""
    r = resolve(p)
    for path in r.skipped:
        print(f"gpu_parts: part {p.number}: {path} is not in this checkout, skipped", flush=True)
    if not r.paths:
        print(f"gpu_parts: part {p.number}: none of its paths exist", flush=True)
        return 0 if p.may_be_empty else 4
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    base = out_dir / f"gpu_tests_part{p.number}_{stamp}"
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rfEs", "--durations=25",
           f"--junitxml={base}.xml", *pytest_args(p), *xdist_args(p), *extra]  # fmt: skip
    print("gpu_parts: " + " ".join(cmd), flush=True)
    start = time.perf_counter()
    last = ""
    with open(f"{base}.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1)  # fmt: skip
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            if line.strip():
                last = line.strip()
        rc = proc.wait()
    wall = time.perf_counter() - start
    if rc == 5 and p.may_be_empty:  # no tests selected
        rc = 0
    summary = dict(part=p.number, covers=p.covers, paths=r.paths, ignore=r.ignore,
                   skipped=r.skipped, wall_s=round(wall, 1), exit_status=rc, pytest=last,
                   git_sha=os.environ.get("HF_PAGED_GIT_SHA"))  # fmt: skip
    Path(f"{base}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        f"gpu_parts: part {p.number}: exit {rc} in {wall:.0f} s; {base}.log/.xml/.json", flush=True
    )
    return rc


def main(argv: list[str]) -> int:
    usage = f"usage: gpu_parts.py list | paths K | run [K] [pytest args]   (K in 1..{len(PARTS)})"
    if not argv or argv[0] not in ("list", "paths", "run"):
        print(usage, file=sys.stderr)
        return 2
    if argv[0] == "list":
        print(markdown())
        return 0
    k = argv[1] if len(argv) > 1 and not argv[1].startswith("-") else ""
    extra = argv[2:] if k else argv[1:]
    try:
        chosen = [part(int(k))] if k else list(PARTS)
    except ValueError as e:
        print(f"gpu_parts: {e}" if "PART" in str(e) else f"gpu_parts: PART={k!r}: {usage}",
              file=sys.stderr)  # fmt: skip
        return 2
    if argv[0] == "paths":
        for p in chosen:
            print(" ".join(pytest_args(p)))
        return 0
    out_dir = Path(os.environ.get("OUT") or ROOT / "evaluation" / "results")
    worst = 0
    for p in chosen:
        worst = max(worst, run(p, extra, out_dir))
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
