"""The package's import graph has no circle: every module's imports, module-level and function-level
alike (and those under ``TYPE_CHECKING``), read with ``ast``, relative imports resolved.

An import names the module it loads. Passing through a package's ``__init__`` on the way is not an edge
of its own: a registry ``__init__`` that imports its members only when called would otherwise make every
package a circle with each of its members."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "fsdpbench"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The package module ``name`` loads (an attribute imported from a module is that module)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module → the package modules it imports anywhere in its text."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    source = node.module or ""
                names = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                target = _target(name, modules)
                if target and target != module:
                    graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert len(graph) > 80  # the whole package was read
    assert circles(graph) == []


def test_the_check_finds_a_circle_through_a_function_level_and_a_relative_import(tmp_path: Path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub.b import thing\n")
    (pkg / "sub" / "b.py").write_text("def thing():\n    from ..c import other\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # into the circle, not part of it
    assert circles(import_graph(pkg)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
