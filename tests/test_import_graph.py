"""The package's import graph has no cycles: every `import mpinfer...` (top level or inside a function) counts.

A cycle hidden in a function-level import still couples the two modules: neither can be read, tested or moved
without the other. `from pkg import submodule` is an edge to the submodule, not to the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mpinfer

ROOT = Path(mpinfer.__file__).resolve().parent


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = ("mpinfer", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    """Module → the mpinfer modules it imports anywhere in its body."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names
                ]
            else:
                continue
            graph[name].update(t for t in targets if t in mods and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles_between_mpinfer_modules():
    graph = import_graph()
    assert len(graph) > 50  # the walk saw the package
    assert cycles(graph) == [], "import cycles (break them by moving the shared code into its own module)"


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Sub-package (``mpinfer.X``: a package or a top-level module) → the sub-packages its modules import."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        packages.setdefault(top(module), set()).update(top(t) for t in targets if top(t) != top(module))
    return packages


def test_package_graph_groups_modules_by_sub_package():
    graph = {"mpinfer.a.x": {"mpinfer.b.y", "mpinfer.a.z"}, "mpinfer.a.z": set(), "mpinfer.b.y": {"mpinfer.c"}}
    assert package_graph(graph) == {"mpinfer.a": {"mpinfer.b"}, "mpinfer.b": {"mpinfer.c"}}


def test_no_import_cycles_between_mpinfer_sub_packages():
    """backends/ ↔ engine/ once imported each other inside functions: no module cycle, but a package cycle."""
    packages = package_graph(import_graph())
    assert {"mpinfer.backends", "mpinfer.engine", "mpinfer.precision", "mpinfer.compare"} <= set(packages)
    found = cycles(packages)
    assert found == [], "import cycles between sub-packages: " + "; ".join(" <-> ".join(c) for c in found)


# precision/'s sub-packages, lowest first: each imports only from those before it, and the recipe (precision's own
# top-level modules: convert, config, options, plandata ...) from all of them. The stages of the recipe, in the order
# docs/architecture.md draws them.
PRECISION_LAYERS = ("core", "emulator", "graph", "rules", "calib", "numerics", "budget")


def precision_layer(module: str) -> int | None:
    """A module's layer in precision/ (``len(PRECISION_LAYERS)`` for the recipe); None outside precision/."""
    parts = module.split(".")
    if parts[:2] != ["mpinfer", "precision"]:
        return None
    if len(parts) > 3 or (len(parts) == 3 and parts[2] in PRECISION_LAYERS):
        return PRECISION_LAYERS.index(parts[2])
    return len(PRECISION_LAYERS)


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """``"a -> b"`` for every import of a precision/ module from a later layer than its own."""
    found = []
    for module, targets in sorted(graph.items()):
        here = precision_layer(module)
        if here is None:
            continue
        for target in sorted(targets):
            there = precision_layer(target)
            if there is not None and there > here:
                found.append(f"{module} -> {target}")
    return found


def test_the_layer_check_finds_an_upward_import():
    graph = {
        "mpinfer.precision.core.plan": {"mpinfer.precision.budget.search"},
        "mpinfer.precision.budget.search": {"mpinfer.precision.core.plan"},
        "mpinfer.precision.convert": {"mpinfer.precision.budget.search"},
        "mpinfer.precision.rules.classify": {"mpinfer.precision.convert"},
    }
    assert upward_imports(graph) == [
        "mpinfer.precision.core.plan -> mpinfer.precision.budget.search",
        "mpinfer.precision.rules.classify -> mpinfer.precision.convert",
    ]


def test_precision_sub_packages_import_only_from_the_layers_below():
    """core <- emulator <- graph <- rules <- calib <- numerics <- budget <- the recipe (convert, options ...)."""
    graph = import_graph()
    sub_packages = {m.split(".")[2] for m in graph if m.startswith("mpinfer.precision.") and m.count(".") >= 3}
    assert sub_packages == set(PRECISION_LAYERS), "a new precision/ sub-package needs its place in PRECISION_LAYERS"
    found = upward_imports(graph)
    assert found == [], "imports against precision/'s layer order: " + "; ".join(found)
