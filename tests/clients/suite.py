"""The client suite's pieces: sizes, fresh-process runs with their time breakdown, result files.

Each client runs the way users start it, in a fresh process, beside stock. A paged process
runs with ``HF_PAGED_TIMINGS`` (``hf_paged/timing/spans.py``), so its wall time splits into imports
(process start to ``import hf_paged``: torch and transformers), model loading (transformers'
``from_pretrained``), engine start (executor build: weights, warm-up with the Triton compiles,
KV cache, CUDA graphs), the engine's own work (its steps) and the client's own work (the rest:
the client library, our adapters' host work, data building, exit).

Sizes (``CLIENTS_SIZE``: ``cpu`` or ``gpu``; default gpu when CUDA is available): ``cpu`` is a
tiny model and a few docs (the code paths, in minutes on 2 cores); ``gpu`` is issue 23's:
Qwen3-0.6B architecture, random bf16 weights, ``max_position_embeddings`` 40960.

Results: one JSON file per session, ``clients_<size>_<UTC stamp>.json``, in
``CLIENTS_RESULTS_DIR`` (default: ``evaluation/results`` for gpu, the session's temp dir for cpu).

Stock's breakdown (``CLIENTS_BREAKDOWN=1``; off by default, as it adds a third process per
pair): after each stock/paged pair, stock's command runs once more under the same timing hooks,
``hf-paged run --timings FILE --backend hf`` (everything stock, the client's phases recorded),
its outputs renamed ``*_timed`` so that nothing the comparison reads is touched; every process
runs alone then, on CPU too. The client's
entry then holds ``stock_breakdown`` beside the paged run's, and ``breakdown_tables``: both
processes' phases side by side (``hf_paged/timing/breakdown.py``) with ours minus stock's
outside model work, issue 29's bar (<= 1 s); the tables also go to ``<results>.breakdown.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from hf_paged.timing.breakdown import SLACK_S, phases, side_by_side

REPO = Path(__file__).resolve().parents[2]
TARGETS = Path(__file__).resolve().parent / "targets"

# printable ASCII without "<" and ">": no text can spell a special token ("<s>", "</s>")
CHARS = [chr(c) for c in range(32, 127) if chr(c) not in "<>"]


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(n))


@dataclass(frozen=True)
class Size:
    """How big every client's run is."""

    name: str
    device: str
    dtype: str  # lm-eval's model_args dtype, and every script's
    lm_eval_batch_size: int
    gen_docs: int
    gen_prefix_chars: int  # the prefix every generate_until doc shares (char tokenizer: tokens)
    max_gen_toks: int
    mc_docs: int
    mc_context_chars: int
    rolling_docs: int
    rolling_chars: int
    fp32_gen_docs: int  # the fp32 checks: strings and loglikelihoods (0: runs are fp32 already)
    fp32_mc_docs: int
    fp32_rolling_docs: int
    pipeline_prompts: int
    pipeline_new_tokens: int
    stock_pipeline_prompts: int  # stock pipelines at batch_size 1 run on the first ones only
    prompts: int  # the script / datasets / Ray / torchrun clients
    new_tokens: int
    timeout_s: int  # per process


# fmt: off
SIZES = {
    "cpu": Size(
        name="cpu", device="cpu", dtype="float32", lm_eval_batch_size=4,
        gen_docs=12, gen_prefix_chars=40, max_gen_toks=16,
        mc_docs=16, mc_context_chars=30, rolling_docs=3, rolling_chars=300,
        fp32_gen_docs=0, fp32_mc_docs=0, fp32_rolling_docs=0,
        pipeline_prompts=6, pipeline_new_tokens=8, stock_pipeline_prompts=6,
        prompts=6, new_tokens=8, timeout_s=600,
    ),
    # issue 23's sizes; stock pipelines (batch_size 1: ~3 s a prompt) run on 8 prompts
    "gpu": Size(
        name="gpu", device="cuda", dtype="bfloat16", lm_eval_batch_size=16,
        gen_docs=384, gen_prefix_chars=400, max_gen_toks=128,
        mc_docs=1000, mc_context_chars=300, rolling_docs=200, rolling_chars=1500,
        fp32_gen_docs=96, fp32_mc_docs=200, fp32_rolling_docs=50,
        pipeline_prompts=64, pipeline_new_tokens=128, stock_pipeline_prompts=8,
        prompts=16, new_tokens=32, timeout_s=580,
    ),
}
# fmt: on


def breakdown_on() -> bool:
    """``CLIENTS_BREAKDOWN=1``: stock's command runs a second time under the timing hooks."""
    value = os.environ.get("CLIENTS_BREAKDOWN", "0")
    if value not in ("0", "1"):
        raise ValueError(f"CLIENTS_BREAKDOWN={value!r} is not allowed: 0 or 1")
    return value == "1"


def current_size() -> Size:
    name = os.environ.get("CLIENTS_SIZE")
    if not name:
        import torch

        name = "gpu" if torch.cuda.is_available() else "cpu"
    if name not in SIZES:
        raise ValueError(f"CLIENTS_SIZE={name!r} is not allowed: one of {sorted(SIZES)}")
    return SIZES[name]


@dataclass
class Run:
    """One client process: its command, exit code, wall time and (paged) time breakdown; the
    timing record of a process that wrote one; a stock run's re-run under the timing hooks."""

    name: str
    system: str  # "stock" or "paged"
    cmd: list[str]
    rc: int
    wall_s: float
    log: str  # the last part of its output
    breakdown: dict = field(default_factory=dict)
    record: dict = field(default_factory=dict)  # spans.snapshot() of the main process
    timed: Run | None = None  # stock: the same command under `hf-paged run --backend hf`

    def check(self) -> Run:
        assert self.rc == 0, f"{self.name} ({self.system}) exited {self.rc}:\n{self.log}"
        return self


def child_env(timings_file: str | None = None, **extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONUNBUFFERED="1")  # fmt: skip
    env.pop("HF_PAGED_BACKEND", None)  # stock stays stock; `hf-paged run` sets it for paged
    env.pop("HF_PAGED_TIMINGS", None)
    if timings_file is not None:
        env["HF_PAGED_TIMINGS"] = timings_file
    env.update(extra)
    return env


@dataclass
class _Started:
    name: str
    system: str
    cmd: list
    proc: subprocess.Popen
    log: object  # the open log file
    t0: float
    timings_file: str | None
    timeout_s: int


def timings_path(workdir: Path, name: str, system: str) -> str:
    return str(workdir / f"{name}.{system}.timings.jsonl")


def timed_stock_command(cmd: list, timings_file: str, outputs: dict | None = None) -> list[str]:
    """Stock's ``[python, -m, MODULE, args...]`` or ``[python, SCRIPT, args...]`` as
    ``[python, -m, hf_paged.entrypoints.cli, run, --timings, FILE, --backend, hf, -m, MODULE,
    args...]`` (``SCRIPT, args...``): the same program, stock, under the timing hooks.
    ``outputs`` maps arguments (output paths) to the ones the re-run writes instead.

    Raises:
        ValueError: a command with python options other than ``-m``.
    """
    python, *rest = [str(c) for c in cmd]
    n = 2 if rest[:1] == ["-m"] else 1
    if not rest[n - 1 :] or (n == 1 and rest[0].startswith("-")):
        raise ValueError(f"cmd={cmd!r} is not allowed: python -m MODULE ... or python SCRIPT ...")
    program, args = rest[:n], rest[n:]
    renames = {str(k): str(v) for k, v in (outputs or {}).items()}
    return [python, "-m", "hf_paged.entrypoints.cli", "run", "--timings", timings_file,
            "--backend", "hf", *program, *[renames.get(a, a) for a in args]]  # fmt: skip


def timed_output(path: Path) -> Path:
    """Where the timed re-run writes what stock writes to ``path``: ``stock.json`` ->
    ``stock_timed.json``, ``stock`` -> ``stock_timed``."""
    return path.with_name(f"{path.stem}_timed{path.suffix}")


def start(name: str, system: str, cmd: list, workdir: Path, timeout_s: int, **env) -> _Started:
    """Start one client process; ``finish`` waits for it. Paged processes record timings
    (``HF_PAGED_TIMINGS``); a ``stock_timed`` command names its own file
    (``timed_stock_command``)."""
    workdir.mkdir(parents=True, exist_ok=True)
    recorded = system in ("paged", "stock_timed")
    timings_file = timings_path(workdir, name, system) if recorded else None
    log = open(workdir / f"{name}.{system}.log", "w")
    t0 = time.perf_counter()
    env_file = timings_file if system == "paged" else None
    proc = subprocess.Popen([str(c) for c in cmd], cwd=workdir, stdout=log,
                            stderr=subprocess.STDOUT, env=child_env(env_file, **env))  # fmt: skip
    return _Started(name, system, [str(c) for c in cmd], proc, log, t0, timings_file, timeout_s)


def finish(*started: _Started) -> list[Run]:
    """Wait for the started processes; each one's wall time ends when it exits (a process past
    its timeout is killed)."""
    ends: dict[int, float] = {}
    while len(ends) < len(started):
        for i, s in enumerate(started):
            if i in ends:
                continue
            if s.proc.poll() is None and time.perf_counter() - s.t0 > s.timeout_s:
                s.proc.kill()
                s.proc.wait()
            if s.proc.poll() is not None:
                ends[i] = time.perf_counter()
        time.sleep(0.05)
    return [_result(s, ends[i]) for i, s in enumerate(started)]


def _result(s: _Started, end: float) -> Run:
    wall = end - s.t0
    s.log.close()
    text = Path(s.log.name).read_text(errors="replace")[-6000:]
    run = Run(s.name, s.system, s.cmd, s.proc.returncode, wall, text)
    if s.timings_file is not None and os.path.exists(s.timings_file):
        run.record = read_timings(s.timings_file)
        if s.system == "paged":
            run.breakdown = breakdown(wall, run.record, s.proc.pid)
    return run


def run_pair(size: Size, name: str, stock_cmd, paged_cmd, workdir: Path,
             stock_out: Path | None = None, **env) -> tuple[Run, Run]:  # fmt: skip
    """Stock and paged runs of one client. On GPU one after the other (clean wall times); on
    CPU at once (the times mean nothing there, the 2 cores halve the suite's time).

    With ``CLIENTS_BREAKDOWN=1``, stock's command then runs once more under the timing hooks
    (``stock.timed``), writing ``timed_output(stock_out)`` where stock writes ``stock_out`` (an
    argument of ``stock_cmd``: pass it when the client writes files). Every process then runs
    alone, on CPU too: phases of a paged run that shared the cores with stock would not compare
    with those of a stock run alone."""
    if size.device == "cpu" and not breakdown_on():
        stock, paged = finish(start(name, "stock", stock_cmd, workdir, size.timeout_s, **env),
                              start(name, "paged", paged_cmd, workdir, size.timeout_s, **env))  # fmt: skip
    else:
        (stock,) = finish(start(name, "stock", stock_cmd, workdir, size.timeout_s, **env))
        (paged,) = finish(start(name, "paged", paged_cmd, workdir, size.timeout_s, **env))
    stock.check()
    paged.check()
    if breakdown_on():
        outputs = {stock_out: timed_output(stock_out)} if stock_out is not None else None
        cmd = timed_stock_command(stock_cmd, timings_path(workdir, name, "stock_timed"), outputs)
        (stock.timed,) = finish(start(name, "stock_timed", cmd, workdir, size.timeout_s, **env))
        stock.timed.check()
    return stock, paged


def run_one(size: Size, name: str, system: str, cmd, workdir: Path, **env) -> Run:
    (run,) = finish(start(name, system, cmd, workdir, size.timeout_s, **env))
    return run.check()


def read_timings(path: str) -> dict:
    """The main process's record: the one with an engine start, else the longest-lived."""
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return max(records, key=lambda r: ("engine_start" in r["spans"], r["uptime_s"] or 0))


def breakdown(wall_s: float, record: dict, started_pid: int) -> dict:
    """The run's wall time split by the engine's process's record. When that process is not
    the one started (a Ray actor, a torchrun rank), its imports overlap the starter's work and
    ``client_s`` is what the wall time leaves besides them."""
    spans = record["spans"]

    def total(name: str) -> float:
        return spans.get(name, {}).get("total_s", 0.0)

    imports = record.get("imports_s") or 0.0
    model_load = total("hf.from_pretrained")
    engine_start = total("engine_start")
    engine_work = total("engine.schedule") + total("engine.step_total")
    main = record["pid"] == started_pid
    uptime = (record.get("uptime_s") or wall_s) if main else wall_s
    steps = {k.split(".", 1)[1]: v["total_s"] for k, v in spans.items()
             if k.startswith("engine_start.")}  # fmt: skip
    return {
        "wall_s": wall_s,
        "engine_process": "the started process" if main else f"pid {record['pid']}, a child",
        "imports_s": imports,
        "model_load_s": model_load,
        "engine_start_s": engine_start,
        "engine_start_steps_s": steps,
        "engine_starts": spans.get("engine_start", {}).get("calls", 0),
        "engine_work_s": engine_work,
        "client_s": max(0.0, uptime - imports - model_load - engine_start - engine_work),
        "engine_share": (engine_start + engine_work) / wall_s if wall_s else None,
    }


class Results:
    """Every client's entry of one session, written to one JSON file as they come."""

    def __init__(self, size: Size, out_dir: Path):
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        out_dir.mkdir(parents=True, exist_ok=True)
        self.path = out_dir / f"clients_{size.name}_{stamp}.json"
        self.doc = {"size": dataclasses.asdict(size), "env": _environment(),
                    "breakdown": breakdown_on(), "clients": []}  # fmt: skip

    def add(self, client: str, runs: list[Run], **facts) -> dict:
        entry = {"client": client, **facts, "runs": [_run_entry(r) for r in runs]}
        stock = [r.wall_s for r in runs if r.system == "stock"]
        paged = [r.wall_s for r in runs if r.system == "paged"]
        if len(stock) == len(paged) == 1:
            entry["wall_ratio_stock_over_paged"] = stock[0] / paged[0]
        tables = _breakdown_tables(runs)
        if tables:
            entry["breakdown_tables"] = tables
            self._write_tables(client, tables)
        self.doc["clients"].append(entry)
        self.path.write_text(json.dumps(self.doc, indent=1))
        return entry

    def _write_tables(self, client: str, tables: list[dict]) -> None:
        md = self.path.with_suffix(".breakdown.md")
        with open(md, "a") as f:
            for t in tables:
                f.write(f"## {client}: {t['run']}\n\n{t['table']}\n\nours - stock outside model "
                        f"work: {t['outside_model_work_diff_s']:+.2f} s (bar: <= "
                        f"{SLACK_S:.0f} s)\n\n")  # fmt: skip


def _breakdown_tables(runs: list[Run]) -> list[dict]:
    """Each pair's stock (timed re-run) and paged phases side by side."""
    paged = {r.name: r for r in runs if r.system == "paged" and r.record}
    out = []
    for stock in runs:
        if stock.system != "stock" or stock.timed is None or not stock.timed.record:
            continue
        if stock.name not in paged:
            continue
        both = side_by_side(stock.timed.record, paged[stock.name].record)
        out.append({"run": stock.name, "table": both["table"],
                    "outside_model_work_diff_s": both["outside_model_work_diff_s"],
                    "within_slack": both["within_slack"]})  # fmt: skip
    return out


def _run_entry(run: Run) -> dict:
    entry = {"system": run.system, "cmd": run.cmd, "wall_s": run.wall_s,
             "breakdown": run.breakdown}  # fmt: skip
    if run.timed is not None:  # the same phases for both sides (the issue 29 table)
        entry["stock_breakdown"] = {"cmd": run.timed.cmd, "wall_s": run.timed.wall_s,
                                    "phases": phases(run.timed.record) if run.timed.record
                                    else {}}  # fmt: skip
    elif run.system == "paged" and run.record and breakdown_on():
        entry["phases"] = phases(run.record)
    return entry


def _environment() -> dict:
    from hf_paged.benchmarks.run_record import environment

    return environment()
