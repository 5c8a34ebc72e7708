"""List the files on the call path from an nn layer's forward to each backend's launcher.

    python tools/engine_path.py                 # from Column/RowParallelLinear.forward
    python tools/engine_path.py --max-files 4   # exit 1 if any path crosses more files

Static: the source is parsed with ``ast``, nothing is imported or run. A call edge goes from a
function (its lambdas and nested functions included) to the functions its calls name, or hand
over as an argument (``call_op(name, impl, ...)``): ``f(...)`` through the module's own
definitions and imports, ``mod.f(...)`` through an imported module, ``Fn.apply(...)`` to an
autograd Function's ``forward``, and ``obj.m(...)`` to every method ``m`` of the classes the
caller's module defines or imports from overlap (``self``, ``run``, ``comm`` and the like are
not typed, so a method name stands for every such method), and ``mod().f(...)`` on a module the
caller imports at run time (``importlib.import_module("overlap...")``) to that module's ``f`` or
what it re-exports. A launcher is a function that starts the transfer or the kernel: a Triton
``kernel[grid](...)`` launch, a torch.distributed P2P or collective call, or the copy worker's
enqueue. For each backend the shortest path through its backend class (fewest files, then fewest
calls) is printed with its files; a file that only re-exports a name is no frame on the path and
is not counted. docs/design/engine.md explains the shape this checks.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "overlap")
STARTS = ("overlap.nn.layers:ColumnParallelLinear.forward",
          "overlap.nn.layers:RowParallelLinear.forward")
# backend -> (its class, which the path goes through; the modules whose launch sites end it)
LAUNCHERS = {"chunked": ("overlap.tp.backends:ChunkedBackend.", "overlap.tp.chunked"),
             "symmetric": ("overlap.tp.backends:SymmetricBackend.", "overlap.tp.symmetric"),
             "triton": ("overlap.tp.backends:TritonBackend.", "overlap.kernels.triton"),
             "unfused": ("overlap.tp.backends:UnfusedBackend.", "overlap.tp.collectives")}
TRANSPORT = {"batch_isend_irecv", "isend", "irecv", "send", "recv", "all_gather_single",
             "reduce_scatter_single", "all_reduce", "all_gather_into_tensor",
             "reduce_scatter_tensor", "submit", "enqueue"}


def _modules() -> dict[str, ast.Module]:
    out = {}
    for dirpath, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                name = name[: -len(".__init__")] if name.endswith(".__init__") else name
                with open(path) as fh:
                    out[name] = ast.parse(fh.read(), path)
    return out


class _Index:
    def __init__(self, mods: dict[str, ast.Module]):
        self.mods = mods
        self.funcs: dict[str, ast.AST] = {}  # "mod:qual" -> node
        self.classes: dict[str, dict[str, str]] = {}  # "mod:Class" -> {method: id}
        self.imports: dict[str, dict[str, str]] = {}  # mod -> {local name: "mod" or "mod:name"}
        self.dynamic: dict[str, list[str]] = {}  # mod -> modules it imports at run time
        for mod, tree in mods.items():
            imp = self.imports[mod] = {}
            self.dynamic[mod] = [n.value for n in ast.walk(tree)
                                 if isinstance(n, ast.Constant) and isinstance(n.value, str)
                                 and n.value in mods and n.value.startswith("overlap.")]
            for node in tree.body:
                if isinstance(node, ast.ImportFrom) and node.module and \
                        node.module.startswith("overlap"):
                    for a in node.names:
                        sub = f"{node.module}.{a.name}"
                        imp[a.asname or a.name] = sub if sub in mods else f"{node.module}:{a.name}"
                elif isinstance(node, ast.Import):
                    for a in node.names:
                        if a.name.startswith("overlap"):
                            imp[a.asname or a.name] = a.name
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    self.funcs[f"{mod}:{node.name}"] = node
                elif isinstance(node, ast.ClassDef):
                    meths = self.classes[f"{mod}:{node.name}"] = {}
                    for item in node.body:
                        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                            fid = f"{mod}:{node.name}.{item.name}"
                            self.funcs[fid] = item
                            meths[item.name] = fid

    def _classes_seen(self, mod: str) -> list[str]:
        own = [c for c in self.classes if c.startswith(mod + ":")]
        for target in self.imports[mod].values():
            if ":" in target and target in self.classes:
                own.append(target)
            elif target in self.mods:
                own += [c for c in self.classes if c.startswith(target + ":")]
        return own

    def callees(self, fid: str) -> set[str]:
        mod = fid.split(":")[0]
        imp, out = self.imports[mod], set()
        for node in ast.walk(self.funcs[fid]):
            if not isinstance(node, ast.Call):
                continue
            for arg in node.args:  # a function handed over to be called (call_op's)
                if isinstance(arg, ast.Name):
                    target = imp.get(arg.id, f"{mod}:{arg.id}")
                    if target in self.funcs:
                        out.add(target)
            f = node.func
            if isinstance(f, ast.Name):
                target = imp.get(f.id, f"{mod}:{f.id}")
                if target in self.funcs:
                    out.add(target)
                elif target in self.classes:  # a constructor
                    init = self.classes[target].get("__init__")
                    if init:
                        out.add(init)
            elif isinstance(f, ast.Attribute):
                base = f.value
                if isinstance(base, ast.Name) and base.id in imp and imp[base.id] in self.mods:
                    target = f"{imp[base.id]}:{f.attr}"
                    if target in self.funcs:
                        out.add(target)
                    continue
                if isinstance(base, ast.Name) and f.attr == "apply":
                    cls = imp.get(base.id, f"{mod}:{base.id}")
                    fwd = self.classes.get(cls, {}).get("forward")
                    if fwd:
                        out.add(fwd)
                    continue
                for cls in self._classes_seen(mod):
                    meth = self.classes[cls].get(f.attr)
                    if meth:
                        out.add(meth)
                for dyn in self.dynamic[mod]:  # importlib.import_module("overlap....").f()
                    target = self.imports[dyn].get(f.attr, f"{dyn}:{f.attr}")
                    if target in self.funcs:
                        out.add(target)
        return out

    def launches(self, fid: str, prefix: str) -> bool:
        if not fid.startswith(prefix):
            return False
        for node in ast.walk(self.funcs[fid]):
            if isinstance(node, ast.Call):
                if isinstance(node.func, ast.Subscript):  # kernel[grid](...)
                    return True
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in TRANSPORT:
                    return True
        return False


def _file(fid: str) -> str:
    mod = fid.split(":")[0]
    base = os.path.join(ROOT, *mod.split("."))
    return os.path.relpath(base + ".py" if os.path.exists(base + ".py")
                           else os.path.join(base, "__init__.py"), ROOT)


def shortest(index: _Index, start: str, through: str, prefix: str) -> list[str] | None:
    """The shortest path from ``start`` through a method of ``through`` to a launcher in
    ``prefix``: each leg fewest files first, then fewest calls."""
    first = _leg(index, start, lambda f: f.startswith(through))
    if first is None:
        return None
    second = _leg(index, first[-1], lambda f: index.launches(f, prefix))
    return None if second is None else first + second[1:]


def _leg(index: _Index, start: str, is_end) -> list[str] | None:
    best = {start: (1, 0)}
    prev: dict[str, str] = {}
    queue = collections.deque([start])
    while queue:
        fid = queue.popleft()
        files, calls = best[fid]
        for nxt in index.callees(fid):
            cost = (files + (_file(nxt) != _file(fid)), calls + 1)
            if nxt not in best or cost < best[nxt]:
                best[nxt], prev[nxt] = cost, fid
                queue.append(nxt)
    ends = [f for f in best if is_end(f)]
    if not ends:
        return None
    end = min(ends, key=lambda f: best[f])
    path = [end]
    while path[-1] != start:
        path.append(prev[path[-1]])
    return path[::-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-files", type=int, default=0,
                    help="exit 1 if a path crosses more files than this (0: report only)")
    args = ap.parse_args()
    index = _Index(_modules())
    worst = 0
    for start in STARTS:
        for backend, (through, prefix) in LAUNCHERS.items():
            path = shortest(index, start, through, prefix)
            if path is None:
                print(f"{start} -> {backend}: no path")
                continue
            files = list(dict.fromkeys(_file(f) for f in path))
            worst = max(worst, len(files))
            print(f"{start.split(':')[1]} -> {backend}: {len(files)} files")
            print("    " + " -> ".join(f.split(":")[1] for f in path))
            print("    " + ", ".join(files))
    if args.max_files and worst > args.max_files:
        print(f"a path crosses {worst} files (> {args.max_files})")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
