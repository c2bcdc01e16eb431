"""Local lm-eval tasks (YAML + JSONL) of the three request kinds, for runs of lm-eval's own CLI.

Each task is one ``<name>.yaml`` beside its ``<name>.jsonl`` in a folder passed to lm-eval as
``--include_path``:

* ``generate_until``: docs ``{"question", "answer"}``, greedy, ``until ["\\n\\n"]``,
  ``max_gen_toks`` new tokens at most, metric ``exact_match``;
* ``multiple_choice``: docs ``{"question", "choices", "label"}``, metric ``acc``;
* ``loglikelihood_rolling``: docs ``{"text"}``, lm-eval's default ``process_results`` for the
  kind (metric ``bits_per_byte``).

:func:`samples` reads a run's ``--log_samples`` file and :func:`agreement` says what two runs'
samples agree on (identical strings, same choice, loglikelihood differences). Plain data: no
lm-eval import. The documents of the lm-eval client runs: ``evaluation/run_lm_eval_cli.py``.
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

HEAD = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
"""
BODY = {
    "generate_until": """doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
metric_list:
  - metric: exact_match
""",
    "multiple_choice": """doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
""",
    "loglikelihood_rolling": """doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: bits_per_byte
""",
}
KINDS = tuple(BODY)


def write_task(folder: Path, name: str, kind: str, docs: list[dict], max_gen_toks: int = 128):
    """``folder/name.yaml`` and ``folder/name.jsonl`` for lm-eval's ``--include_path``.

    Raises:
        ValueError: ``kind`` is not one of ``KINDS``.
    """
    if kind not in BODY:
        raise ValueError(f"kind={kind!r} is not allowed: must be one of {list(KINDS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    yaml = HEAD.format(name=name, data=data, kind=kind)
    (folder / f"{name}.yaml").write_text(yaml + BODY[kind].format(max_gen_toks=max_gen_toks))


def samples(out: Path, task: str) -> list[dict]:
    """The samples ``--log_samples`` wrote for ``task`` under ``out`` (the newest file), in
    document order; [] when there is none."""
    paths = glob.glob(f"{out}/**/samples_{task}_*.jsonl", recursive=True)
    if not paths:
        return []
    with open(sorted(paths)[-1]) as f:
        return sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])


def _score(resp) -> float:
    """A response's loglikelihood: ``[[lp, is_greedy]]`` (loglikelihood) or ``[lp]`` (rolling)."""
    v = resp[0]
    return float(v[0] if isinstance(v, (list, tuple)) else v)


def _argmax(xs: list[float]) -> int:
    return max(range(len(xs)), key=xs.__getitem__)


def agreement(kind: str, stock: list[dict], paged: list[dict], rel_tol: float = 1e-6,
              abs_tol: float = 1e-4) -> dict:  # fmt: skip
    """What two runs' samples of a ``kind`` task agree on: ``docs``, ``same_arguments``, and
    ``identical_strings`` / ``differing_docs`` (generate_until), or ``same_choice``
    (multiple_choice), ``max_abs_loglikelihood_diff``, ``all_finite`` and ``not_close`` (the
    loglikelihood pairs outside ``rel_tol`` / ``abs_tol``, at most 3 listed). No bar is
    asserted here; ``comparable`` is False when the runs' document counts differ or are 0."""
    facts: dict = {"docs": len(stock), "comparable": bool(stock) and len(stock) == len(paged)}
    if not facts["comparable"]:
        return {**facts, "paged_docs": len(paged)}
    facts["same_arguments"] = [s["arguments"] for s in stock] == [s["arguments"] for s in paged]
    if kind == "generate_until":
        differ = [s["doc_id"] for s, p in zip(stock, paged) if s["resps"] != p["resps"]]
        return {**facts, "identical_strings": len(stock) - len(differ), "differing_docs": differ}
    scores = [([_score(r) for r in a["resps"]], [_score(r) for r in b["resps"]])
              for a, b in zip(stock, paged)]  # fmt: skip
    if kind == "multiple_choice":
        picks = [(_argmax(x), _argmax(y)) for x, y in scores]
        facts["same_choice"] = sum(p == q for p, q in picks) / len(picks)
    pairs = [(x, y) for a, b in scores for x, y in zip(a, b)]
    facts["max_abs_loglikelihood_diff"] = max(abs(x - y) for x, y in pairs)
    facts["all_finite"] = all(math.isfinite(y) for _, y in pairs)
    bad = [(x, y) for x, y in pairs if not math.isclose(x, y, rel_tol=rel_tol, abs_tol=abs_tol)]
    facts["not_close"] = {"count": len(bad), "examples": bad[:3]}
    return facts


def subprocess_env(checkout: str) -> dict:
    """The environment of an lm-eval run in a subprocess: ``checkout`` on ``PYTHONPATH``, one
    thread, nothing from the hub, and no ``HF_PAGED_BACKEND`` (each command says itself whether
    it runs paged)."""
    from hf_paged import envs

    return envs.child_environment(
        drop=("HF_PAGED_BACKEND",),
        PYTHONPATH=checkout,
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )


def run_side_by_side(cmds: dict[str, list[str]], env: dict, cwd: str, log_dir: str,
                     timeout: float) -> dict[str, tuple[int, str]]:  # fmt: skip
    """Start every command at once (stock and paged together: half the wall time of one after
    the other), each writing ``<log_dir>/<name>.log``; wait for each. Returns ``{name: (exit
    code, log text)}``."""
    import subprocess

    procs = {}
    for name, cmd in cmds.items():
        log = open(Path(log_dir) / f"{name}.log", "w")  # noqa: SIM115 - closed below
        procs[name] = (subprocess.Popen(cmd, env=env, cwd=cwd, stdout=log, stderr=log), log)
    out = {}
    for name, (proc, log) in procs.items():
        rc = proc.wait(timeout=timeout)
        log.close()
        out[name] = (rc, Path(log.name).read_text())
    return out


def check_served(runs: dict[str, tuple[int, str]], served: tuple[str, ...]) -> None:
    """``run_side_by_side``'s stock and paged runs: both exited 0, and the paged one fell back
    nowhere and its log holds each line of ``served`` (what shows the engine did the work).
    Raises AssertionError with the log's end otherwise."""
    for name, (rc, text) in runs.items():
        assert rc == 0, f"{name} lm_eval failed:\n{text[-3000:]}"
        if name == "paged":
            assert "PagedFallbackWarning" not in text, text[-3000:]
            for line in served:
                assert line in text, f"{line!r} not in the paged log:\n{text[-3000:]}"
