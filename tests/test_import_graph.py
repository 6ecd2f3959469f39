"""The package's import graph has no cycle, and the core does not import the DeepSpeed face.

Read with ``ast`` from the source, so every import statement counts: module level, inside
functions (deferred), and under ``if TYPE_CHECKING`` (typing-only). A cycle of any of these kinds
means two modules cannot be understood, tested or moved apart; a deferred import that only hides one
is still one. The implicit import of a module's parent packages (``import zerotune.zero.build`` runs
``zerotune/__init__.py`` first) is Python's, not a dependency the code chose, and is not an edge.
Imports through ``importlib.import_module`` with a computed name (the alias table) are data, not edges.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "zerotune"
PACKAGE = "zerotune"
# The DeepSpeed face (issue 29): compat translates DeepSpeed's names onto the core. The package's
# front doors -- ``zerotune/__init__.py`` (``import zerotune as deepspeed``) and the ``zerotune`` CLI
# (``deepspeed-alias``, ``run --as-deepspeed``) -- may import it; nothing else may.
FACE = f"{PACKAGE}.compat"
FRONT_DOORS = (PACKAGE, f"{PACKAGE}.cli")


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    modules = {}
    for path in PACKAGE_ROOT.rglob("*.py"):
        parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import sub`` imports the submodule; ``from mod import obj`` the module.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import zerotune.a.b.obj``-style: the deepest module
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    known = set(modules)
    return {name: imported_modules(name, path, known) for name, path in modules.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the components of more than one module (the cycles)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_reader_sees_deferred_and_typing_only_imports(tmp_path):
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "if TYPE_CHECKING:\n    from zerotune.engine import Engine\n"
              "def later():\n    from . import comm\n    import zerotune.zero.build\n")
    module = tmp_path / "example.py"
    module.write_text(source)
    known = {"zerotune", "zerotune.engine", "zerotune.pipe", "zerotune.pipe.comm", "zerotune.zero",
             "zerotune.zero.build"}
    assert imported_modules("zerotune.pipe.example", module, known) == {
        "zerotune.engine", "zerotune.pipe.comm", "zerotune.zero.build"}


def test_tarjan_finds_a_cycle_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert strongly_connected(graph) == [["a", "b", "c"]]


def test_the_package_import_graph_has_no_cycle():
    graph = import_graph()
    assert len(graph) > 200, "the walk found too few modules: is PACKAGE_ROOT right?"
    cycles = strongly_connected(graph)
    described = ["; ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in cycles]
    assert not cycles, "import cycles (module -> the members of its cycle it imports):\n" + "\n".join(described)


def test_only_the_front_doors_import_the_deepspeed_face():
    graph = import_graph()
    offenders = {module: sorted(t for t in targets if t == FACE or t.startswith(FACE + "."))
                 for module, targets in graph.items()
                 if not (module == FACE or module.startswith(FACE + "."))
                 and not any(module == door or module.startswith(door + ".") for door in FRONT_DOORS[1:])
                 and module != PACKAGE}
    offenders = {module: targets for module, targets in offenders.items() if targets}
    assert not offenders, f"core modules importing zerotune.compat: {offenders}"


def test_packages_import_downward_as_docs_architecture_says():
    graph = import_graph()
    for lower, upper in (("zerotune.offload", "zerotune.zero"), ("zerotune.parallel", "zerotune.pipe")):
        upward = sorted((module, target) for module, targets in graph.items() for target in targets
                        if module.startswith(lower + ".") and (target == upper or target.startswith(upper + ".")))
        assert not upward, f"{lower} imports {upper}: {upward}"
