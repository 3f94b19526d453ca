"""The import layers of fastgrad/: each module imports only from its own layer or below, and the import graph
has no cycle.

Every ``import``/``from ... import`` statement counts, module level or inside a function (a function-local
import is still a dependency; it only runs later). Importing ``fastgrad.a.b`` also runs ``fastgrad.a``'s
``__init__``, so it depends on that package too (except the root ``fastgrad`` package, which every submodule
import runs and which sits on the top layer). A module missing from LAYERS fails the test: place a new
module in the order on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import fastgrad

ROOT = Path(fastgrad.__file__).resolve().parent

# Bottom first. A module may import modules of its own layer or of a lower one.
LAYERS: list[list[str]] = [
    # 0: no fastgrad imports: build facts, torch's captured functions, the decisions every route shares
    ["fastgrad._archs", "fastgrad._buildplan", "fastgrad._smoke", "fastgrad._torch_fns", "fastgrad.decide"],
    # the first-use build of the compiled extension
    ["fastgrad._build"],
    # 1: the compiled extension's loader
    ["fastgrad._ext"],
    # 2: one-pass list scans (the registry hands its selector down to it: _scan.set_selector)
    ["fastgrad._scan"],
    # 3: what every backend shares
    ["fastgrad.backends.base"],
    # 4: Triton kernels (imported by the triton backend, and only when a call needs them)
    ["fastgrad.triton_kernels.multi_tensor"],
    ["fastgrad.triton_kernels.norm"],
    ["fastgrad.triton_kernels.clip"],
    ["fastgrad.triton_kernels.amp", "fastgrad.triton_kernels.agc", "fastgrad.triton_kernels.centralize",
     "fastgrad.triton_kernels.stats"],
    ["fastgrad.triton_kernels"],
    # 5: the backends, then their registry
    ["fastgrad.backends.torch_backend", "fastgrad.backends.triton_backend", "fastgrad.backends.ext_backend"],
    ["fastgrad.backends"],
    # 6: helpers of the public ops: input checks and the exact norm's arithmetic; the sharded reduction: its
    # DTensor adapters and one collective, which ranks reduce together, a list's local view, what each kind of
    # call reduces, then the package; the passes over a list (reads and writes per device); the exact norm's
    # readings (its sharded form rides on that package's collective) and a GradScaler's state; the plan of a
    # list's route, which chooses among those readings
    ["fastgrad._inputs", "fastgrad.exact", "fastgrad.distributed.dtensor", "fastgrad.distributed.agreement"],
    ["fastgrad.distributed.plan"],
    ["fastgrad.distributed.layout"],
    ["fastgrad.distributed.reduce"],
    ["fastgrad.distributed"],
    ["fastgrad.passes"],
    ["fastgrad.exact_reads", "fastgrad.scaler_state"],
    ["fastgrad.route"],
    # 7: public ops
    ["fastgrad.clip", "fastgrad.agc", "fastgrad.centralize", "fastgrad.stats"],
    ["fastgrad.amp"],
    ["fastgrad.optim_clip"],
    # the step guard: its parts, each mode one file (every module of fastgrad/guard/modes/ but its base and
    # package: MODE_FILES), then the core and the package
    ["fastgrad.guard.ledger"],
    ["fastgrad.guard.modes.base", "fastgrad.guard.counters", "fastgrad.guard.skip"],
    ["fastgrad.guard.modes.*"],
    ["fastgrad.guard.modes"],
    ["fastgrad.guard.options", "fastgrad.guard.read", "fastgrad.guard.buffers", "fastgrad.guard.finite"],
    ["fastgrad.guard.core"],
    ["fastgrad.guard"],
    # 8: diagnosis, above the ops it calls: collection below rules below advice below rendering, then the
    # objects that wire them (a step's report, a run's result, the monitor, the script runner)
    ["fastgrad.diagnose", "fastgrad.diagnose.collect", "fastgrad.diagnose.rules", "fastgrad.diagnose.render",
     "fastgrad.diagnose.thresholds", "fastgrad.diagnose.finding"],
    ["fastgrad.diagnose.collect.identity", "fastgrad.diagnose.collect.snapshot", "fastgrad.diagnose.collect.history",
     "fastgrad.diagnose.collect.loss_inputs",
     "fastgrad.diagnose.collect.watch", "fastgrad.diagnose.collect.nonfinite", "fastgrad.diagnose.collect.steps"],
    ["fastgrad.diagnose.collect.interceptors", "fastgrad.diagnose.collect.manual",
     "fastgrad.diagnose.collect.naming", "fastgrad.diagnose.collect.optimizer_hooks",
     "fastgrad.diagnose.collect.bookkeeping", "fastgrad.diagnose.collect.readout", "fastgrad.diagnose.collect.buffers",
     "fastgrad.diagnose.collect.logs", "fastgrad.diagnose.collect.targets", "fastgrad.diagnose.collect.children",
     "fastgrad.diagnose.collect.saturation"],
    ["fastgrad.diagnose.collect.ranks"],
    ["fastgrad.diagnose.collect.hooks"],
    ["fastgrad.diagnose.rules.trends", "fastgrad.diagnose.rules.base"],
    ["fastgrad.diagnose.rules.evidence"],
    ["fastgrad.diagnose.rules.buffers"],
    ["fastgrad.diagnose.rules.step", "fastgrad.diagnose.rules.nonfinite", "fastgrad.diagnose.rules.exploding",
     "fastgrad.diagnose.rules.loss_diverging", "fastgrad.diagnose.rules.clip_zeroes",
     "fastgrad.diagnose.rules.run_state", "fastgrad.diagnose.rules.skips", "fastgrad.diagnose.rules.norm_trends",
     "fastgrad.diagnose.rules.lr_zero", "fastgrad.diagnose.rules.lr_schedule", "fastgrad.diagnose.rules.rewrite",
     "fastgrad.diagnose.rules.stall", "fastgrad.diagnose.rules.never_learns",
     "fastgrad.diagnose.rules.norm_miscounted", "fastgrad.diagnose.rules.validation", "fastgrad.diagnose.rules.frozen",
     "fastgrad.diagnose.rules.probabilities_ce", "fastgrad.diagnose.rules.accum_not_divided",
     "fastgrad.diagnose.rules.weight_decay", "fastgrad.diagnose.rules.ascent",
     "fastgrad.diagnose.rules.saturation"],
    ["fastgrad.diagnose.rules.zero_grads", "fastgrad.diagnose.rules.last_step", "fastgrad.diagnose.rules.red_flags"],
    ["fastgrad.diagnose.rules.registry"],
    ["fastgrad.diagnose.advice", "fastgrad.diagnose.consistency", "fastgrad.diagnose.policy"],
    ["fastgrad.diagnose.render.step_text", "fastgrad.diagnose.render.run_text", "fastgrad.diagnose.render.plot"],
    ["fastgrad.diagnose.report"],
    ["fastgrad.diagnose.result", "fastgrad.diagnose.loggers"],
    ["fastgrad.diagnose.monitor", "fastgrad.diagnose.run", "fastgrad.diagnose.launch"],
    ["fastgrad.patch"],
    # 9: the package and its command-line tools
    ["fastgrad", "fastgrad.check", "fastgrad.info", "fastgrad.build"],
    # optional adapters of the step guard to training frameworks (imported only by their users)
    ["fastgrad.integrations", "fastgrad.integrations._common"],
    ["fastgrad.integrations.lightning", "fastgrad.integrations.transformers"],
    ["fastgrad.benchmark.timing", "fastgrad.benchmark.workloads", "fastgrad.benchmark.ops", "fastgrad.benchmark.counting"],
    ["fastgrad.benchmark.runner"],
    ["fastgrad.benchmark.report"],
    ["fastgrad.benchmark", "fastgrad.bench"],
]
# a folder whose every module sits on one layer (adding a guard mode is adding its file, nothing else)
MODE_FILES = "fastgrad.guard.modes.*"


def _levels() -> dict[str, int]:
    level = {mod: i for i, layer in enumerate(LAYERS) for mod in layer if mod != MODE_FILES}
    folder = MODE_FILES[:-1]
    for mod in _modules():
        if mod.startswith(folder) and mod not in level:
            level[mod] = next(i for i, layer in enumerate(LAYERS) if MODE_FILES in layer)
    return level


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


LEVEL = _levels()


def _resolve(importer: str, is_pkg: bool, node: ast.AST, known: set[str]) -> set[str]:
    """fastgrad modules that ``node`` (an Import or ImportFrom) makes ``importer`` run."""
    targets: list[str] = []
    if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
    else:
        if node.level:
            base = importer.split(".") if is_pkg else importer.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            mod = ".".join(base + ([node.module] if node.module else []))
        else:
            mod = node.module or ""
        subs = [f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known]
        # `from pkg import name`: a submodule when there is one, else a name defined by pkg itself
        targets = subs + ([mod] if len(subs) < len(node.names) else [])
    own_packages = {importer.rsplit(".", i)[0] for i in range(importer.count(".") + 1)}
    if not is_pkg:
        own_packages.discard(importer)
    out = set()
    for t in targets:
        if not (t == "fastgrad" or t.startswith("fastgrad.")):
            continue
        out.add(t)
        # importing fastgrad.a.b first runs package fastgrad.a, unless the importer is inside it already
        parts = t.split(".")
        for i in range(len(parts) - 1, 1, -1):
            parent = ".".join(parts[:i])
            if parent in known and parent not in own_packages:
                out.add(parent)
    out.discard(importer)
    return out


def import_graph(sources: dict[str, str] | None = None) -> dict[str, set[str]]:
    """module -> the fastgrad modules it imports (all import statements, wherever they are)."""
    mods = _modules()
    if sources is None:
        sources = {m: p.read_text() for m, p in mods.items()}
    known = set(sources)
    graph = {}
    for mod, src in sources.items():
        is_pkg = mods[mod].name == "__init__.py" if mod in mods else False
        deps: set[str] = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                deps |= _resolve(mod, is_pkg, node, known)
        graph[mod] = deps
    return graph


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    out = []
    for mod, deps in sorted(graph.items()):
        for dep in sorted(deps):
            if LEVEL[dep] > LEVEL[mod]:
                out.append(f"{mod} (layer {LEVEL[mod]}) imports {dep} (layer {LEVEL[dep]})")
    return out


def private_imports(sources: dict[str, str] | None = None) -> list[str]:
    """``from <a fastgrad module> import _name`` statements: a private name of another module (a private
    submodule, ``from . import _scan``, is a module and allowed). What modules share gets a public name."""
    mods = _modules()
    if sources is None:
        sources = {m: p.read_text() for m, p in mods.items()}
    known = set(sources)
    out = []
    for mod, src in sorted(sources.items()):
        is_pkg = mods[mod].name == "__init__.py" if mod in mods else False
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                source = ".".join(base[: len(base) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if not (source == "fastgrad" or source.startswith("fastgrad.")):
                continue
            for a in node.names:
                if a.name.startswith("_") and not a.name.startswith("__") and f"{source}.{a.name}" not in known:
                    out.append(f"{mod}:{node.lineno} imports {source}.{a.name}")
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_every_module_has_a_layer():
    missing = sorted(set(_modules()) - set(LEVEL))
    assert not missing, f"place these modules in tests/test_layers.py LAYERS: {missing}"
    stale = sorted(set(LEVEL) - set(_modules()))
    assert not stale, f"LAYERS names modules that no longer exist: {stale}"


def test_no_module_imports_from_a_layer_above():
    bad = layer_violations(import_graph())
    assert not bad, "imports from a higher layer:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_imports_a_private_name_of_another():
    bad = private_imports()
    assert not bad, "private names imported across modules (give them a public name where they live):\n" + \
        "\n".join(bad)


@pytest.mark.parametrize("importer, stmt", [
    ("fastgrad.distributed.reduce", "from .agreement import _op_of\n"),
    ("fastgrad.guard.read", "def f():\n    from ..passes import _private\n"),
    ("fastgrad.route", "from fastgrad.distributed.plan import _build_plan as build\n"),
])
def test_reintroduced_private_import_is_caught(importer, stmt):
    mods = _modules()
    sources = {m: p.read_text() for m, p in mods.items()}
    sources[importer] += "\n" + stmt
    assert private_imports(sources), stmt


MAX_CLASS_LINES = 400


def long_classes(sources: dict[str, str] | None = None) -> list[str]:
    """Classes of fastgrad/ longer than MAX_CLASS_LINES (from ``class`` to the class's last line)."""
    if sources is None:
        sources = {m: p.read_text() for m, p in _modules().items()}
    out = []
    for mod, text in sorted(sources.items()):
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_CLASS_LINES:
                    out.append(f"{mod}.{node.name}: {n} lines")
    return out


def test_no_class_over_the_size_bound():
    bad = long_classes()
    assert not bad, f"classes over {MAX_CLASS_LINES} lines (split them along their seams):\n" + "\n".join(bad)


def test_a_class_at_the_bound_passes_and_one_line_over_fails():
    def sized(n):  # a class of exactly n lines
        return "class Big:\n" + "    x = 0\n" * (n - 1)

    assert not long_classes({"m": sized(MAX_CLASS_LINES)})
    assert long_classes({"m": sized(MAX_CLASS_LINES + 1)}) == [f"m.Big: {MAX_CLASS_LINES + 1} lines"]


def test_graph_sees_known_edges():
    g = import_graph()
    assert "fastgrad._scan" in g["fastgrad.backends.base"]
    assert "fastgrad.backends" in g["fastgrad.passes"]  # via `from .backends.torch_backend import ...`
    assert "fastgrad.backends.torch_backend" in g["fastgrad.passes"]
    assert "fastgrad.triton_kernels" in g["fastgrad.backends.triton_backend"]  # function-local import
    assert "fastgrad.clip" in g["fastgrad.diagnose.collect.hooks"]  # `from ... import clip as fg_clip`, in a function


@pytest.mark.parametrize("importer, stmt", [
    # the two cycles this test was written against, reintroduced as function-local imports
    ("fastgrad._scan", "def f():\n    from .backends import selects_builtin\n"),
    ("fastgrad.clip", "def f():\n    from .patch import TORCH\n"),
    ("fastgrad.backends.ext_backend", "def f():\n    from . import select_automatic\n"),
    ("fastgrad.backends.base", "import fastgrad.stats\n"),
])
def test_reintroduced_upward_import_is_caught(importer, stmt):
    mods = _modules()
    sources = {m: p.read_text() for m, p in mods.items()}
    sources[importer] += "\n" + stmt
    g = import_graph(sources)
    assert layer_violations(g), stmt
    assert find_cycle(g) is not None, stmt


def test_registry_hands_its_functions_down():
    # The lower layers reach the registry only through what it hands them at import; if that wiring were
    # lost, _scan's one-call CPU fast paths would quietly decline every call (correct but slow).
    from fastgrad import _scan, backends
    from fastgrad.backends import ext_backend

    assert _scan.builtin_selector() is backends.selects_builtin
    assert ext_backend._REGISTRY_FNS == {"select_automatic": backends.select_automatic,
                                         "get_default_backend": backends.get_default_backend}
