"""The package's import graph: no cycles and no imports that run back up, at every level; and
the tests' own: no test module imports another (shared helpers live in ``hf_paged.testing``, a
folder's ``conftest.py`` or a helper module without the ``test_`` prefix).

Every ``import`` of an ``hf_paged`` module in ``hf_paged/`` (module level or inside a function,
``TYPE_CHECKING`` blocks included) is an arrow from the importing file to the imported one. At
each folder, its children (files and subfolders, a subfolder standing for everything under it)
must import each other without a cycle: then every child stands above everything it imports, and
no arrow runs back up. Imports made by name at run time (``importlib.import_module``) are not
arrows: they are how the lazy registries and ``import hf_paged``'s hooks stay light.

A folder is a room: none holds over 15 modules (a folder of one-file-per-family model adapters
excepted), no module outside ``kernels/`` runs over 400 lines, and ``engine/core/`` (the plain-data side of the engine) imports no torch, neither
itself nor through another module of the package it imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hf_paged"
TESTS = ROOT / "tests"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest prefix of ``name`` that is a module of the package."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            names = [f"{base}.{a.name}" for a in node.names] + [base]
        for n in names:
            target = _resolve(n, modules)
            if target is not None and target != module:
                out.add(target)
    return out


def _external_imports(path: Path) -> set[str]:
    """The top-level names of the modules outside the package that ``path`` imports (module
    level or inside a function, ``TYPE_CHECKING`` blocks included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.split(".")[0])
    return found - {"hf_paged"}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _child(folder: str, module: str) -> str | None:
    """The child of ``folder`` (a package name) that ``module`` lies in, or None outside it."""
    if module == folder:
        return None
    if not module.startswith(folder + "."):
        return None
    return module[len(folder) + 1 :].split(".")[0]


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of a directed graph as a list of nodes, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m) :] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)):
            return found
    return None


def _folders(graph: dict[str, set[str]]) -> list[str]:
    return sorted({m for m in graph if (PACKAGE.parent / m.replace(".", "/")).is_dir()})


def test_no_cycles_at_any_level():
    graph = _graph()
    assert len(graph) > 50  # the walk found the package
    found = []
    for folder in _folders(graph):
        edges: dict[str, set[str]] = {}
        for src, targets in graph.items():
            a = _child(folder, src)
            if a is None:
                continue
            for dst in targets:
                b = _child(folder, dst)
                if b is not None and b != a:
                    edges.setdefault(a, set()).add(b)
        cycle = _cycle(edges)
        if cycle:
            found.append(f"{folder}: {' -> '.join(cycle)}")
    assert not found, (
        "import cycles (each child of a folder must stand above what it imports):\n"
        + "\n".join(found)
    )


MAX_MODULES_PER_FOLDER = 15
# folders of one file per model family: they grow with the families served, not with concepts
ADAPTER_FOLDERS = {"hf_paged.models.generic.adapters"}
CORE = "hf_paged.engine.core"
HEAVY = ("torch", "triton", "numpy", "transformers")


def test_no_folder_holds_over_15_modules():
    graph = _graph()
    crowded = []
    for folder in _folders(graph):
        if folder in ADAPTER_FOLDERS:
            continue
        path = PACKAGE.parent / folder.replace(".", "/")
        modules = [p.name for p in path.glob("*.py") if p.name != "__init__.py"]
        if len(modules) > MAX_MODULES_PER_FOLDER:
            crowded.append(f"{folder}: {len(modules)} modules")
    assert not crowded, (
        f"folders over {MAX_MODULES_PER_FOLDER} modules (a folder this full holds two rooms):\n"
        + "\n".join(crowded)
    )


MAX_MODULE_LINES = 400  # kernels/ excepted: a Triton kernel and its launcher read as one


def test_no_module_over_400_lines_outside_kernels():
    long = [
        f"{p.relative_to(ROOT)}: {n} lines"
        for p in sorted(PACKAGE.rglob("*.py"))
        if "kernels" not in p.relative_to(PACKAGE).parts
        and (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not long, "modules over 400 lines (split by concept):\n" + "\n".join(long)


def _reached(graph: dict[str, set[str]], start: set[str]) -> dict[str, str]:
    """Every module reached from ``start`` along import arrows -> the module it was reached from
    (a start module -> itself)."""
    via = {m: m for m in start}
    todo = sorted(start)
    while todo:
        m = todo.pop()
        for n in sorted(graph.get(m, ())):
            if n not in via:
                via[n] = m
                todo.append(n)
    return via


def test_engine_core_imports_no_torch():
    """What ``engine/core/`` imports, directly or through the package's modules it imports,
    holds no torch (nor triton, numpy, transformers): the scheduler side is plain Python."""
    graph = _graph()
    core = {m for m in graph if m == CORE or m.startswith(CORE + ".")}
    assert len(core) > 5  # the walk found the core
    via = _reached(graph, core)
    found = []
    for module in sorted(via):
        path = _modules()[module]
        heavy = sorted(_external_imports(path) & set(HEAVY))
        if heavy:
            chain = [module]
            while via[chain[-1]] != chain[-1]:
                chain.append(via[chain[-1]])
            found.append(f"{' <- '.join(chain)} imports {heavy}")
    assert not found, "engine/core reaches heavy imports:\n" + "\n".join(found)


def test_a_heavy_import_is_found():
    """The check itself: an import of torch inside a function and a chain of two arrows."""
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "d": set()}
    assert _reached(graph, {"a"}) == {"a": "a", "b": "a", "c": "b"}
    path = ROOT / "hf_paged" / "engine" / "worker" / "runner_memory.py"
    assert "torch" in _external_imports(path)


def test_a_cycle_is_found():
    """The check itself: a graph with a cycle two folders deep is reported."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None


@pytest.mark.parametrize(
    "code",
    [
        "import hf_paged.engine.core.scheduler, hf_paged.engine.core.block_manager, "
        "hf_paged.engine.core.request, hf_paged.engine.core.request_loop, "
        "hf_paged.engine.core.request_state, "
        "hf_paged.engine.core.contracts, hf_paged.engine.core.stop",
        "import hf_paged",
        "from hf_paged.entrypoints.cli import build_parser; build_parser().format_help()",
    ],
    ids=["pure-python-core", "import-hf_paged", "cli-help"],
)
def test_light_imports_load_no_torch(code):
    """The pure-Python core, ``import hf_paged`` and ``hf-paged --help`` load neither torch nor
    transformers (which take seconds): what keeps them quick (``evaluation/bench_startup.py``
    times them)."""
    probe = f"import sys; {code}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_import_hf_paged_patches_on_transformers_load():
    """``import hf_paged``'s one side effect: the dispatchers are on once transformers loads the
    modules they patch, in either import order."""
    probe = (
        "import sys\n"
        "{first}\n{second}\n"
        "from transformers.generation.utils import GenerationMixin\n"
        "import transformers\n"
        "print(hasattr(GenerationMixin.generate, '__hf_paged_original__'), "
        "hasattr(transformers.pipeline, '__hf_paged_original__'))"
    )
    for first, second in (("import hf_paged", "import transformers.pipelines"),
                          ("import transformers.pipelines", "import hf_paged")):  # fmt: skip
        code = probe.format(first=first, second=second)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip().splitlines()[-1] == "True True", (first, second)


def _imported_tests_files(source: str) -> set[Path]:
    """The files under ``tests/`` that ``source`` imports (``tests.x.y`` names, module level or
    inside a function), as paths that exist."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.split(".")[0] != "tests":
                continue
            path = ROOT.joinpath(*name.split(".")).with_suffix(".py")
            if path.is_file():
                found.add(path)
    return found


def _is_test_module(path: Path) -> bool:
    return path.name.startswith("test_") or path.name == "conftest.py"


def test_no_test_module_imports_another():
    """A test module (or conftest) imported by another file in ``tests/`` runs its tests or
    fixtures twice and ties two features' tests together: what both need goes to
    ``hf_paged.testing``, the folder's ``conftest.py`` or a helper module there."""
    files = sorted(TESTS.rglob("*.py"))
    assert sum(_is_test_module(p) for p in files) > 50  # the walk found the tests
    found = []
    for path in files:
        for target in sorted(_imported_tests_files(path.read_text())):
            if _is_test_module(target):
                found.append(f"{path.relative_to(ROOT)} imports {target.relative_to(ROOT)}")
    assert not found, "test modules imported by other files:\n" + "\n".join(found)


def test_an_imported_test_module_is_found():
    """The check itself: the import shapes that tied test modules together are seen."""
    sources = [
        "from tests.engine import test_engine_parity as parity",
        "from tests.engine.test_engine_parity import hf_greedy",
        "def f():\n    import tests.integration.conftest",
    ]
    for source in sources:
        assert any(_is_test_module(p) for p in _imported_tests_files(source)), source
    helper = _imported_tests_files("from tests.integration.fake_engine import FakeEngine")
    assert helper == {TESTS / "integration" / "fake_engine.py"}
    assert not _is_test_module(TESTS / "integration" / "fake_engine.py")


# ---- tests mirror the package ----------------------------------------------------------------

# test folders with no namesake under hf_paged/, and why
NOT_MIRRORED = {
    "clients": "real clients (lm-eval's CLI, pipelines, datasets.map, Ray, torchrun, scripts) "
    "run end to end in fresh processes beside stock; it holds their targets and helpers",
    "reliability": "the fault, fuzz and soak tests: each drives the whole package "
    "through its front ends, so no one folder owns it",
    "real_model": "the demo model's real weights through every front end (generate, pipeline, "
    "LLM, lm-eval, the sampler) beside stock; no one folder owns it",
}
# hardware and run mode: a marker (``gpu``, ``multi_gpu``) or a parameter, never a file name
HARDWARE_WORDS = ("gpu", "cuda", "cpu", "h100", "h200", "interpret", "interpreter", "kernels",
                  "device", "nccl", "gloo", "host")  # fmt: skip


def _test_folders() -> list[Path]:
    """Every folder under tests/ that holds Python files, outside the ``NOT_MIRRORED`` trees."""
    found = []
    for path in sorted(TESTS.rglob("*")):
        rel = path.relative_to(TESTS)
        if not path.is_dir() or "__pycache__" in rel.parts or rel.parts[0] in NOT_MIRRORED:
            continue
        if any(path.glob("*.py")):
            found.append(path)
    return found


def test_tests_mirror_the_package():
    """A reader finds a module's tests by its folder: tests/X/Y tests hf_paged/X/Y (a root
    module's tests sit in tests/ itself)."""
    folders = _test_folders()
    assert len(folders) > 5  # the walk found the test folders
    missing = [
        str(f.relative_to(ROOT)) for f in folders if not (PACKAGE / f.relative_to(TESTS)).is_dir()
    ]
    assert not missing, (
        "test folders without a namesake folder under hf_paged/ (move them, or list them in "
        f"NOT_MIRRORED with the reason): {missing}"
    )
    stale = [name for name in NOT_MIRRORED if not (TESTS / name).is_dir()]
    assert not stale, f"NOT_MIRRORED names folders that are gone: {stale}"


def test_no_test_file_is_named_after_hardware():
    """Hardware and run mode (the Triton interpreter, a device, NCCL, the host) are markers
    (``gpu``, ``multi_gpu``) and parameters; a concept's tests live in one file whatever they
    run on."""
    named = [
        str(p.relative_to(ROOT))
        for p in sorted(TESTS.rglob("test_*.py"))
        if any(word in p.stem.split("_")[1:] for word in HARDWARE_WORDS)
    ]
    assert not named, f"test files named after hardware: {named}"


# ---- one request shape ----------------------------------------------------------------------


def _add_request_signatures(source: str) -> list[tuple[int, list[str]]]:
    """``(line, parameter names but self)`` of every ``def add_request`` in ``source``, and the
    annotation of its one parameter (``[name, annotation]``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "add_request":
            args = node.args
            params = [a for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg != "self"]
            extra = [a.arg for a in (args.vararg, args.kwarg) if a is not None]
            shape = [
                f"{a.arg}: {ast.unparse(a.annotation) if a.annotation else ''}" for a in params
            ]
            found.append((node.lineno, shape + [f"*{e}" for e in extra]))
    return found


def test_one_add_request_signature():
    """A request has one shape from the front end to the scheduler: every ``add_request`` of the
    package (and of the tests' stand-in engines) takes one ``EngineRequest`` and nothing else; a
    new kind of input is a field of ``EngineRequest``, not a parameter."""
    found, bad = 0, []
    for path in sorted([*PACKAGE.rglob("*.py"), *TESTS.rglob("*.py")]):
        for line, shape in _add_request_signatures(path.read_text()):
            found += 1
            if shape != ["request: EngineRequest"]:
                bad.append(f"{path.relative_to(ROOT)}:{line} add_request({', '.join(shape)})")
    assert found >= 2  # the engine's and the fake engine's
    assert not bad, "add_request must take one EngineRequest:\n" + "\n".join(bad)


def test_a_second_add_request_shape_is_found():
    """The check itself."""
    assert _add_request_signatures("def add_request(self, request: EngineRequest): ...") == [
        (1, ["request: EngineRequest"])
    ]
    shape = _add_request_signatures("def add_request(self, ids, params=None, *, proposer=None):0")
    assert shape == [(1, ["ids: ", "params: ", "proposer: "])]


# ---- one owner per piece of state -------------------------------------------------------------

# writes into another object's ``__dict__`` or ``_private`` attributes that are allowed: each on a
# foreign object (torch, transformers, lm-eval) at the edge where the package adapts it, keyed by
# (file, the object written), with why
FOREIGN_WRITES = {
    ("hf_paged/distributed/process_group.py", "opts._timeout"):
        "torch's ProcessGroup options have no public setter",
    ("hf_paged/distributed/process_group.py", "opts._devices"):
        "torch's ProcessGroupGloo options have no public setter",
    ("hf_paged/integration/auto.py", "skeleton.config._name_or_path"):
        "a transformers config's path, as from_pretrained sets it",
    ("hf_paged/timing/client.py", "timed._hf_paged_span"):
        "a wrapper function the module itself built",
    ("hf_paged/integration/engine_owner.py", "model.__dict__"):
        "the engine owner on a user's HF model, as a plain attribute (not a submodule)",
    ("hf_paged/integration/lm_eval/install.py", "hflm_cls._loglikelihood_tokens"):
        "lm-eval's HFLM method patched (and restored) by install / uninstall",
    ("hf_paged/integration/pipeline/capture.py", "view.__dict__"):
        "a throwaway copy of a transformers pipeline",
    ("hf_paged/models/generic/adapters/alibi.py", "module.__dict__"):
        "a cached tensor on an HF module (not a buffer, not a submodule)",
    ("hf_paged/models/generic/adapters/roformer.py", "module.__dict__"):
        "a checked-once flag on an HF module",
    ("hf_paged/models/generic/model.py", "modules[name].__dict__"):
        "an HF attention module's binding to its paged layer",
    ("hf_paged/models/generic/model.py", "module._buffers"):
        "an HF module's buffer replaced in place (torch has no public setter)",
    ("hf_paged/models/generic/build.py", "module._buffers"):
        "meta buffers of an HF module materialised (torch has no public setter)",
    ("hf_paged/models/generic/fusions.py", "m.__dict__"):
        "a fused HF linear's group, without registering a submodule",
    ("hf_paged/models/generic/tp.py", "mod._parameters"):
        "an HF module's parameter replaced by its shard",
    ("hf_paged/models/generic/tp.py", "module.__dict__"):
        "an HF module's communicator, without registering a submodule",
    ("hf_paged/models/generic/weights.py", "model.get_submodule(owner)._parameters"):
        "a tied HF parameter shared in place",
}  # fmt: skip
_DICT_WRITERS = ("update", "setdefault", "pop", "popitem", "clear", "__setitem__")


def _foreign_writes(source: str) -> list[tuple[int, str]]:
    """``(line, object written)`` for every write into another object's state: ``x._a = v``,
    ``x._a[k] = v``, ``del x._a``, ``x.__dict__[k] = v`` and ``x.__dict__.update(...)`` (and
    the other mutating dict methods), where ``x`` is not ``self`` / ``cls``."""
    found = []

    def foreign(node) -> bool:
        return not (isinstance(node, ast.Name) and node.id in ("self", "cls"))

    for node in ast.walk(ast.parse(source)):
        targets = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = node.targets
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            inner = node.func.value
            if node.func.attr in _DICT_WRITERS and isinstance(inner, ast.Attribute):
                if inner.attr == "__dict__" and foreign(inner.value):
                    found.append((node.lineno, ast.unparse(inner)))
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                while isinstance(t, ast.Subscript):
                    t = t.value
                if not isinstance(t, ast.Attribute) or not foreign(t.value):
                    continue
                private = t.attr.startswith("_") and not t.attr.startswith("__")
                if private or t.attr == "__dict__":
                    found.append((node.lineno, ast.unparse(t)))
    return sorted(found)


def test_no_object_writes_another_objects_state():
    """The owner of a piece of state is the only one who writes it: no module writes another
    object's ``_private`` attributes or its ``__dict__`` (a table hung on an engine, a queue
    edited from outside its scheduler), but for the foreign objects listed in
    ``FOREIGN_WRITES``."""
    seen, found = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for line, what in _foreign_writes(path.read_text()):
            seen.add((rel, what))
            if (rel, what) not in FOREIGN_WRITES:
                found.append(f"{rel}:{line} writes {what}")
    assert not found, "writes into another object's state:\n" + "\n".join(found)
    stale = sorted(set(FOREIGN_WRITES) - seen)
    assert not stale, f"FOREIGN_WRITES lists writes that are gone: {stale}"


def test_a_foreign_write_is_found():
    """The check itself: the shapes of such a write are seen; one's own state is not."""
    source = (
        "engine.__dict__.setdefault('t', {})\n"
        "engine.__dict__['t'] = 1\n"
        "sched._queue.append(1)\n"  # a call on it is a read of the attribute: not seen
        "sched._queue = []\n"
        "sched._table[k] = v\n"
        "self._mine = 1\n"
        "engine.public = 1\n"
    )
    assert _foreign_writes(source) == [
        (1, "engine.__dict__"), (2, "engine.__dict__"), (4, "sched._queue"), (5, "sched._table")
    ]  # fmt: skip


# ---- refusals: returned where judged, raised once, their keys listed once ---------------------

# the files that raise a ``Refusal`` as ``PagedFallback``, and what each is the boundary of
FALLBACK_BOUNDARIES = {
    "hf_paged/integration/route.py": "a generate call: everything judged on its route",
    "hf_paged/integration/engine_owner.py": "a model's engine: built (or refused), held",
    "hf_paged/integration/paged_call.py": "one generate call's cache duties (passed, returned)",
}
FALLBACK_MODULE = "hf_paged/integration/fallback.py"


def _fallback_raises(source: str) -> tuple[list[int], list[int]]:
    """``(lines that build a PagedFallback from its fields, lines that raise one)``."""
    built, raised = [], []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "PagedFallback":
                built.append(node.lineno)
        if isinstance(node, ast.Raise) and node.exc is not None:
            if "PagedFallback" in ast.unparse(node.exc):
                raised.append(node.lineno)
    return built, raised


def test_refusals_are_raised_at_one_boundary():
    """A judgement returns a ``Refusal`` where it is made; only the boundaries raise it (as
    ``PagedFallback.of(refusal)``), and nothing but ``fallback.py`` builds a ``PagedFallback``
    from a key and a detail."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        built, raised = _fallback_raises(path.read_text())
        if rel != FALLBACK_MODULE:
            found += [f"{rel}:{line} builds PagedFallback(reason, detail)" for line in built]
        if rel not in FALLBACK_BOUNDARIES:
            found += [f"{rel}:{line} raises PagedFallback" for line in raised]
    assert not found, "return a Refusal instead (the boundaries raise it):\n" + "\n".join(found)
    for rel in FALLBACK_BOUNDARIES:
        assert _fallback_raises((ROOT / rel).read_text())[1], f"{rel} no longer raises"


def _reason_keys(source: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """``([(line, key)] of Refusals built with a literal key, [(line, expression)] of the
    others)``."""
    literal, other = [], []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        func = node.func
        if not (isinstance(func, ast.Name) and func.id == "Refusal"):
            continue
        key = node.args[0]
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            literal.append((node.lineno, key.value))
        else:
            other.append((node.lineno, ast.unparse(key)))
    return literal, other


# Refusals whose key is built where they are made: (file, the key's expression) -> the keys it
# can be (each must be a listed key or family)
BUILT_KEYS = {
    ("hf_paged/integration/prepare.py", "mode.value"): (
        "contrastive_search", "dola_generation", "group_beam_search", "constrained_beam_search",
    ),
    ("hf_paged/integration/prepare.py", "flag"): ("output_attentions", "output_hidden_states"),
    ("hf_paged/models/peft.py", "f'peft_{kind.lower()}'"): ("peft_dora",),
    ("hf_paged/models/peft.py", "f'peft_{kind}'"): ("peft_ia3",),
    ("hf_paged/models/servable.py", "f'quantized_{method}'"): ("quantized_gptq",),
    ("hf_paged/refusal.py", "f'{prefix}{self.reason}'"): ("assistant_device",),
}  # fmt: skip


def test_reason_keys_are_listed_once():
    """Every reason key the package makes is in ``refusal.REASONS`` (or a family of
    ``REASON_FAMILIES``), so that each new key is a visible decision; and every listed key is
    still made somewhere and has its row in ``docs/fallbacks.md``."""
    from hf_paged import refusal

    made, unlisted, unknown = set(), [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        literal, other = _reason_keys(path.read_text())
        for line, key in literal:
            made.add(key)
            if not refusal.is_reason(key):
                unlisted.append(f"{rel}:{line} {key!r}")
        for line, expr in other:
            keys = BUILT_KEYS.get((rel, expr))
            if keys is None:
                unknown.append(f"{rel}:{line} Refusal({expr}, ...)")
                continue
            made.update(keys)
            unlisted += [f"{rel}:{line} {k!r}" for k in keys if not refusal.is_reason(k)]
    assert not unlisted, "reason keys not in refusal.REASONS:\n" + "\n".join(unlisted)
    assert not unknown, "keys built at run time, not in BUILT_KEYS:\n" + "\n".join(unknown)
    stale = sorted(k for k in refusal.REASONS if k not in made)
    assert not stale, f"refusal.REASONS lists keys nothing makes: {stale}"
    doc = (ROOT / "docs" / "fallbacks.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in doc.splitlines()
            if line.startswith("| `")}  # fmt: skip
    want = set(refusal.REASONS) | {f"{p}*" for p in refusal.REASON_FAMILIES}
    assert rows == want, (
        f"docs/fallbacks.md rows differ from refusal.REASONS: missing {sorted(want - rows)}, "
        f"extra {sorted(rows - want)} (python -m hf_paged.refusal prints the table)"
    )


def test_a_raise_and_an_unlisted_key_are_found():
    """The checks themselves."""
    assert _fallback_raises("raise PagedFallback('x', 'y')\n") == ([1], [1])
    assert _fallback_raises("raise PagedFallback.of(r)\n") == ([], [1])
    assert _reason_keys("Refusal('new_key', 'why')\nRefusal(k, 'why')\n") == (
        [(1, "new_key")],
        [(2, "k")],
    )
