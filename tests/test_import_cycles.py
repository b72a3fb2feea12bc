"""No import circle inside batchrun (batchrun/, kernels/ installed as batchrun.kernels, connectors/ as
batchrun.connectors): every strongly connected component of the module import graph is one module.

The graph is read from the source with `ast`, as a static import-graph tool reads it: an import at module
level and one inside a function both count (a lazy import only hides a circle until the function runs);
imports under `if TYPE_CHECKING:` do not (they never run). `import a.b.c` / `from a.b import c` is an edge
to the deepest batchrun module the name resolves to (a.b.c when it is a module, else the package a.b);
relative imports resolve against the importing module's package. Importing a package's submodule is not
counted as importing the package's __init__ too. Components come from networkx (which torch requires).
"""
from __future__ import annotations

import ast
import os

import networkx as nx

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# source folder -> the package it installs as (pyproject.toml's package-dir)
ROOTS = {"batchrun": "batchrun", "kernels": "batchrun.kernels", "connectors": "batchrun.connectors"}


def source_modules(repo: str = REPO) -> dict[str, tuple[str, bool]]:
    """Dotted module name -> (file, is a package __init__) for every .py file under ROOTS."""
    out = {}
    for folder, package in ROOTS.items():
        for root, dirs, files in os.walk(os.path.join(repo, folder)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            rel = os.path.relpath(root, os.path.join(repo, folder))
            prefix = package if rel == "." else f"{package}.{rel.replace(os.sep, '.')}"
            for name in files:
                if name.endswith(".py"):
                    init = name == "__init__.py"
                    out[prefix if init else f"{prefix}.{name[:-3]}"] = (os.path.join(root, name), init)
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every Import/ImportFrom in the tree, at any depth, except the bodies of `if TYPE_CHECKING:`."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _is_type_checking(node):
            children = node.orelse
        stack.extend(children)


def _deepest(name: str, modules) -> str | None:
    """The longest prefix of dotted `name` that is a known module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in modules:
            return candidate
    return None


def module_imports(module: str, file: str, is_package: bool, modules) -> set[str]:
    """The batchrun modules `module` (read from `file`) imports."""
    tree = ast.parse(open(file, encoding="utf-8").read(), file)
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports pkg.sub when sub is a module, else a name of pkg
            names = [f"{base}.{a.name}" if base else a.name for a in node.names] or [base]
            names = [n if n in modules else base for n in names]
        out |= {t for t in (_deepest(n, modules) for n in names) if t and t != module}
    return out


def import_graph(repo: str = REPO) -> dict[str, set[str]]:
    """Module -> the batchrun modules it imports."""
    modules = source_modules(repo)
    return {m: module_imports(m, f, init, modules) for m, (f, init) in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module, each as one circle through it
    (a -> b -> ... -> a), sorted."""
    g = nx.DiGraph()
    g.add_nodes_from(graph)
    g.add_edges_from((a, b) for a, targets in graph.items() for b in targets)
    out = []
    for component in nx.strongly_connected_components(g):
        if len(component) > 1:
            cycle = [a for a, _ in nx.find_cycle(g.subgraph(component))]
            start = cycle.index(min(cycle))
            cycle = cycle[start:] + cycle[:start]
            out.append(cycle + [cycle[0]])
    return sorted(out)


def test_the_cycle_finder_finds_a_circle_and_only_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}, "f": {"g"}, "g": {"f"}}
    assert import_cycles(graph) == [["a", "b", "c", "a"], ["f", "g", "f"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_graph_reads_lazy_and_relative_imports_and_skips_type_checking(tmp_path):
    pkg = tmp_path / "batchrun"
    (pkg / "models").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "models" / "x.py").write_text("from . import y\n")
    (pkg / "models" / "y.py").write_text("def f():\n    from batchrun.models.x import g\n")
    (pkg / "models" / "z.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                         "    from .x import g\nimport batchrun.models.y.sub\n")
    graph = import_graph(str(tmp_path))
    assert graph["batchrun.models.x"] == {"batchrun.models.y"}
    assert graph["batchrun.models.y"] == {"batchrun.models.x"}
    assert graph["batchrun.models.z"] == {"batchrun.models.y"}
    assert import_cycles(graph) == [["batchrun.models.x", "batchrun.models.y", "batchrun.models.x"]]


def test_no_import_circle_in_batchrun():
    graph = import_graph()
    assert "batchrun.kernels.cpu_gemm" in graph and "batchrun.connectors.base" in graph   # the roots were read
    cycles = import_cycles(graph)
    assert not cycles, "import circles: " + "; ".join(" -> ".join(c) for c in cycles)
