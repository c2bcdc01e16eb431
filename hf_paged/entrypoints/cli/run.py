"""``hf-paged run``: run a program unmodified, every ``generate`` call on the paged engine.

Like ``python script.py args`` / ``python -m module args``, with ``HF_PAGED_BACKEND=paged`` set
(child processes inherit it), the ``generate`` and ``pipeline`` dispatchers installed and lm-eval's
HFLM patched. ``--report`` prints to stderr at exit what the engine served.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import runpy
import sys

from hf_paged.entrypoints.cli.errors import say_error

USAGE = """usage: hf-paged run [--report] [--timings FILE] [--backend paged|hf] script.py [args ...]
       hf-paged run [--report] [--timings FILE] [--backend paged|hf] -m module [args ...]

Run a program unmodified, with every transformers generate call on the paged engine
(HF_PAGED_BACKEND=paged; child processes inherit it).

options:
  -h, --help        show this help message and exit
  --report          print to stderr at exit what the engine served (default: off)
  --timings FILE    append the process's time breakdown (imports, model load, engine start,
                    the client's setup, tokenization, requests, model work and results) to
                    FILE as one JSON line (default: none)
  --backend paged|hf  paged: generate on the engine; hf: the program runs stock under the same
                    timing hooks, for a side-by-side breakdown (evaluation/breakdown.py)
                    (default: paged)
  -m module         run a module as `python -m module` does (default: a script)"""
BACKENDS = ("paged", "hf")


class ServedCounter:
    """Counts what the paged engine served, by wrapping the functions every front end calls:
    ``generate`` calls (``paged_call.generate_paged``: the dispatcher and
    ``PagedModelForCausalLM``), pipeline batches streamed through one engine run, and lm-eval
    requests (generate_until, loglikelihood, loglikelihood_rolling)."""

    def __init__(self):
        self.counts = {"generate call(s)": 0, "pipeline batch(es)": 0, "lm-eval request(s)": 0}
        self._saved: list[tuple[object, str, object]] = []

    def _wrap(self, module, name: str, key: str, amount) -> None:
        original = getattr(module, name)

        def counted(*args, **kwargs):
            out = original(*args, **kwargs)  # a PagedFallback raised here ran stock instead
            self.counts[key] += amount(args)
            return out

        self._saved.append((module, name, original))
        setattr(module, name, counted)

    def install(self) -> None:
        from hf_paged.integration import paged_call
        from hf_paged.integration.pipeline import streaming

        self._wrap(paged_call, "generate_paged", "generate call(s)", lambda a: 1)
        self._wrap(streaming, "model_outputs", "pipeline batch(es)", lambda a: 1)
        if importlib.util.find_spec("lm_eval") is not None:
            from hf_paged.integration.lm_eval import generate_until, loglikelihood

            requests = lambda a: len(a[1])  # noqa: E731  (lm, requests, ...)
            self._wrap(generate_until, "generate_until", "lm-eval request(s)", requests)
            self._wrap(loglikelihood, "loglikelihood_tokens", "lm-eval request(s)", requests)

    def uninstall(self) -> None:
        for module, name, original in reversed(self._saved):
            setattr(module, name, original)
        self._saved.clear()

    @property
    def calls(self) -> int:
        """``generate`` calls the engine served."""
        return self.counts["generate call(s)"]

    @property
    def streamed(self) -> int:
        """Pipeline batches that came back from a streamed engine run."""
        return self.counts["pipeline batch(es)"]

    def summary(self) -> str:
        return ", ".join(f"{n} {what}" for what, n in self.counts.items())


def _usage_error(message: str) -> None:
    """One line, as every ``hf-paged`` command fails (``errors.py``), and exit with 2."""
    raise SystemExit(say_error("run", message))


def parse(argv: list[str]) -> tuple[dict, str | None, str | None, list[str]]:
    """``(options, module, script, args)`` from what follows ``run``, parsed as python parses
    its own command line: our options stop at the first program argument. ``options`` holds
    ``report`` (bool), ``timings`` (a path or None) and ``backend``."""
    opts: dict = {"report": False, "timings": None, "backend": "paged"}
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(USAGE)
            raise SystemExit(0)
        if arg == "--report":
            opts["report"], i = True, i + 1
            continue
        name, eq, value = arg.partition("=")
        if name not in ("--timings", "--backend"):
            _usage_error(f"option {arg!r} is not allowed: options are --report, "
                         "--timings FILE, --backend paged|hf, -m")  # fmt: skip
        if not eq:
            if i + 1 >= len(argv):
                _usage_error(f"{name} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        if name == "--backend" and value not in BACKENDS:
            _usage_error(f"--backend={value!r} is not allowed: one of {', '.join(BACKENDS)}")
        opts[name[2:]] = value
    rest = argv[i:]
    if rest[:1] == ["-m"]:
        if len(rest) < 2:
            _usage_error("-m needs a module name: hf-paged run -m module [args ...]")
        if not _is_module(rest[1].partition(".")[0], os.getcwd()):  # as a missing script
            _usage_error(f"module={rest[1]!r} is not allowed: no such module")
        return opts, rest[1], None, rest[2:]
    if not rest:
        _usage_error("missing the program: hf-paged run script.py [args ...]")
    if not os.path.isfile(rest[0]):
        hint = ""
        if rest[0].replace(".", "").replace("_", "").isalnum() and _is_module(rest[0]):
            hint = f"; {rest[0]!r} is a module: hf-paged run -m {' '.join(rest)}"
        _usage_error(f"script={rest[0]!r} is not allowed: no such file{hint}")
    return opts, None, rest[0], rest[1:]


def _is_module(name: str, first: str | None = None) -> bool:
    """``name`` can be imported (with ``first`` at the front of the path, as ``python -m``
    puts the working directory); a top-level name imports nothing to tell."""
    saved = list(sys.path)
    if first is not None:
        sys.path.insert(0, first)
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False
    finally:
        sys.path[:] = saved


def cmd_run(argv: list[str]) -> int:
    opts, module, script, args = parse(argv)
    report = opts["report"]
    os.environ["HF_PAGED_BACKEND"] = opts["backend"]  # child processes inherit it
    if opts["timings"]:
        os.environ["HF_PAGED_TIMINGS"] = os.path.abspath(opts["timings"])
    from hf_paged import envs

    envs.reset("HF_PAGED_BACKEND")  # this process reads them again too (they are read once)
    envs.reset("HF_PAGED_TIMINGS")
    _show_engine_starts()
    from hf_paged.integration import hooks
    from hf_paged.integration.lm_eval import install_lm_eval

    # `import hf_paged` installed the generate and pipeline dispatchers for when transformers
    # loads them (nothing is imported before the program needs it); again here for the timing
    # hooks, as --timings may have set HF_PAGED_TIMINGS after that import
    hooks.install_on_import()
    install_lm_eval()  # HFLM's requests on the engine; `--model hf-paged` (when lm-eval is there)
    counter = ServedCounter()
    if report:
        counter.install()
    try:
        if module is not None:
            sys.argv = [module, *args]  # run_module replaces argv[0] with the module's file
            sys.path.insert(0, os.getcwd())
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [script, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
            runpy.run_path(script, run_name="__main__")
    finally:
        if report:
            counter.uninstall()
            print(f"hf_paged: served by the paged engine: {counter.summary()}",
                  file=sys.stderr, flush=True)  # fmt: skip
    return 0


def _show_engine_starts() -> None:
    """Engine starts and their reasons on stderr (the ``hf_paged`` logger), unless the program
    configures that logger itself."""
    logger = logging.getLogger("hf_paged")
    if logger.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
