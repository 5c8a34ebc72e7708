"""The package's layers, from its own source: no import circles, and every import goes down.

The graph holds every ``import overlap...`` / ``from overlap... import`` of every module under
``overlap/`` (module level and inside functions alike, relative ones resolved), read with
``ast`` (nothing is imported). A package's ``__init__`` is its own node (``overlap.nn.__init__``);
importing ``overlap.a.b`` counts as an import of ``overlap.a.b`` only, not of the packages'
``__init__`` Python runs first. ``LAYERS`` (bottom first) is the order, written once: each
module belongs to the entry that names it most specifically; an import may go to its own layer
or one below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.no_delay_pass("imports only")

ROOT = Path(__file__).resolve().parent.parent / "overlap"

# Bottom first. An entry names a module and everything under it; a more specific entry wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("overlap.errors", "overlap.defaults", "overlap.versions", "overlap.cli")),
    # The names, ranges, timers and sync detector every layer reports through.
    ("instrumentation", ("overlap.kernels.registry", "overlap.profile.names",
                         "overlap.profile.nvtx", "overlap.profile.timers",
                         "overlap.profile.syncs")),
    # The package's __init__ asks dist.device whether a GPU is there (Triton's mode).
    ("transport", ("overlap.__init__", "overlap.dist", "overlap.symm.base")),
    ("kernels", ("overlap.kernels", "overlap._C")),
    ("symmetric memory", ("overlap.symm",)),
    ("fused ops", ("overlap.tp", "overlap.comm")),
    ("pipeline, data parallel, offloading", ("overlap.pp", "overlap.dp", "overlap.memory")),
    ("context parallel", ("overlap.cp",)),
    ("nn", ("overlap.nn",)),
    ("moe", ("overlap.moe",)),
    # ParallelDims builds every group and hands out the TP and EP communicators.
    ("mesh", ("overlap.dist.dims", "overlap.dist.__init__")),
    ("models", ("overlap.models",)),
    # parallelize finds a model's plan (overlap.models) over the nn core (overlap.nn.apply).
    ("model-aware entry", ("overlap.nn.parallelize", "overlap.nn.__init__")),
    ("profile", ("overlap.profile",)),
    ("plan", ("overlap.plan",)),
    ("train", ("overlap.train",)),
    ("selftest", ("overlap.selftest",)),
]
EXTENSIONS = ("overlap._C",)  # compiled from csrc/; not a source file


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _node(name: str) -> str | None:
    """The graph node of a dotted name: a module, a package's __init__, or an extension."""
    for cand in (name, f"{name}.__init__"):
        if cand in MODULES or cand in EXTENSIONS:
            return cand
    return None


def _base(module: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".")[:-1]  # a.b.c's and a.b.__init__'s package: a.b
    package = package[:len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """(imported node, line) for every overlap import of ``module``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _base(module, node)
            # ``from P import x``: the module P.x if there is one, else a name of P.
            names = [f"{base}.{a.name}" if _node(f"{base}.{a.name}") else base
                     for a in node.names]
        for name in names:
            if name != "overlap" and not name.startswith("overlap."):
                continue
            while _node(name) is None and "." in name:  # import a.b.c of an attribute
                name = name.rpartition(".")[0]
            target = _node(name)
            if target is not None and target != module:
                found.append((target, node.lineno))
    return found


GRAPH = {m: _imports(m, p) for m, p in MODULES.items()}


def _layer(module: str) -> int | None:
    best, where = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for e in entries:
            if (module == e or module.startswith(e + ".")) and len(e) > best:
                best, where = len(e), i
    return where


def _cycle() -> list[str] | None:
    """One import cycle, as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for target, _ in GRAPH.get(m, ()):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state:
                found = visit(target)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(GRAPH):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def _where(a: str, b: str) -> str:
    line = next(n for t, n in GRAPH[a] if t == b)
    return f"{MODULES[a].relative_to(ROOT.parent)}:{line}"


def test_the_graph_holds_module_level_function_local_and_package_imports():
    # Known edges of each kind, so a parser that missed one kind could not pass the rest.
    edges = {m: {t for t, _ in ts} for m, ts in GRAPH.items()}
    assert "overlap.models.tp_plans" in edges["overlap.nn.parallelize"]  # inside a function
    assert "overlap.profile.nvtx" in edges["overlap.train.job"]  # from overlap.profile import
    assert "overlap.dist.dims" in edges["overlap.dist.__init__"]
    assert "overlap._C" in edges["overlap.tp.stamps"]
    assert len(MODULES) > 150 and sum(map(len, GRAPH.values())) > 1000


def test_no_import_cycle():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle) + " (" + "; ".join(
        f"{_where(a, b)} imports {b}" for a, b in zip(cycle, cycle[1:])) + ")"


def test_every_module_has_a_layer():
    missing = sorted(m for m in MODULES if _layer(m) is None)
    assert not missing, f"modules in no entry of LAYERS (tests/test_layers.py): {missing}"


def test_every_import_goes_to_the_same_or_a_lower_layer():
    up = []
    for m, targets in sorted(GRAPH.items()):
        mine = _layer(m)
        for target, line in targets:
            theirs = _layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                up.append(f"{MODULES[m].relative_to(ROOT.parent)}:{line}: {m} (layer "
                          f"'{LAYERS[mine][0]}') imports {target} (layer '{LAYERS[theirs][0]}', "
                          "above it)")
    assert not up, f"{len(up)} import(s) up the layers:\n" + "\n".join(up)
