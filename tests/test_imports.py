"""The package's import graph: layers that import only the layers below them (the
import-linter contract in pyproject.toml), no import cycle, and no module importing
another module's private names. Each failure names the offending imports."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys

import pytest

grimp = pytest.importorskip("grimp")  # with import-linter: the checks' own tools (scripts/setup.sh)

PACKAGE = "seqpar_kernels"
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_layers_import_only_the_layers_below_them():
    result = subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports())"],
        cwd=REPOSITORY, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def _strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The import cycles of the graph: its strongly connected components of more than
    one module, or of one module that imports itself (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(module):
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == module:
                    break
            if len(component) > 1 or module in graph.find_modules_directly_imported_by(module):
                components.append(sorted(component))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return components


def _describe_cycle(graph: grimp.ImportGraph, component: list[str]) -> str:
    members = set(component)
    lines = []
    for importer in component:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & members):
            for detail in graph.get_import_details(importer=importer, imported=imported):
                lines.append(f"  {importer} -> {imported} (l.{detail['line_number']}: {detail['line_contents']})")
    return "\n".join(lines)


def test_no_import_cycle_in_the_package():
    graph = grimp.build_graph(PACKAGE)
    # The package's own __init__ imports its public modules to export them: it is the
    # top of the graph, and a module that imports `seqpar_kernels` itself would close a
    # cycle through it, which this test reports too.
    cycles = _strongly_connected(graph)
    assert not cycles, "import cycles:\n" + "\n\n".join(_describe_cycle(graph, cycle) for cycle in cycles)


def _package_files() -> list[str]:
    root = os.path.join(REPOSITORY, PACKAGE)
    return sorted(
        os.path.join(folder, name) for folder, _, names in os.walk(root) for name in names if name.endswith(".py")
    )


def _module_name(path: str) -> str:
    relative = os.path.relpath(path, REPOSITORY)[: -len(".py")].replace(os.sep, ".")
    return relative[: -len(".__init__")] if relative.endswith(".__init__") else relative


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _private_imports(path: str) -> list[str]:
    """`from M import _name` and `M._name` of a package module M in the file at path,
    where _name is not itself a module (the compiled extension _C is one)."""
    this = _module_name(path)
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    found, module_aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == PACKAGE:
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and node.module != this \
                        and not _is_module(f"{node.module}.{name}"):  # fmt: skip
                    found.append(f"l.{node.lineno}: from {node.module} import {name}")
                elif _is_module(f"{node.module}.{name}"):
                    module_aliases[alias.asname or name] = f"{node.module}.{name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == PACKAGE and alias.asname:
                    module_aliases[alias.asname] = alias.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_aliases:
            target = module_aliases[node.value.id]
            if node.attr.startswith("_") and not node.attr.startswith("__") and target != this:
                found.append(f"l.{node.lineno}: {target}.{node.attr}")
    return found


def test_no_module_imports_another_modules_private_names():
    found = {os.path.relpath(path, REPOSITORY): _private_imports(path) for path in _package_files()}
    found = {path: uses for path, uses in found.items() if uses}
    assert not found, "private names of other modules used:\n" + "\n".join(
        f"  {path} {use}" for path, uses in found.items() for use in uses
    )
