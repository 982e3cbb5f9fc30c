"""The README and the manual in docs/ say what the code does: every relative link and
anchor resolves; every Python block is valid Python whose names from the package exist
and whose calls of the package's functions pass arguments their signatures take (a
renamed function or keyword fails here); and every complete example is a file of
examples/ as it is, which tests/test_readme_example.py runs under torchrun."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]
EXAMPLES = {path.read_text(): path.name for path in sorted((ROOT / "examples").glob("*.py"))}


def page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def python_blocks(page: Path) -> list[tuple[int, str]]:
    """(line, source) of each ```python block of the page."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def anchors(page: Path) -> set[str]:
    """The anchors of the page's headings, as GitHub makes them."""
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        fenced ^= line.startswith("```")
        heading = re.match(r"#{1,6} (.*)", line)
        if heading and not fenced:
            found.add(re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_and_anchors_resolve(page):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        destination = (page.parent / path).resolve() if path else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_the_readme_is_a_landing_page():
    # The manual lives in docs/, one page a topic; the README links to every page.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    unlinked = [page.name for page in (ROOT / "docs").glob("*.md") if f"](docs/{page.name})" not in readme]
    assert not unlinked, unlinked


class PackageUses(ast.NodeVisitor):
    """What a block takes from the package: its aliases of seqpar_kernels modules and
    names, and each call of one of them with its arguments."""

    def __init__(self):
        self.aliases: dict[str, object] = {}
        self.problems: list[str] = []

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.startswith("seqpar_kernels"):
                module = importlib.import_module(alias.name)
                self.aliases[alias.asname or alias.name.split(".")[0]] = (
                    module if alias.asname else importlib.import_module("seqpar_kernels")
                )

    def visit_ImportFrom(self, node):
        if node.module and node.module.startswith("seqpar_kernels"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    self.problems.append(f"{node.module} has no {alias.name}")
                else:
                    self.aliases[alias.asname or alias.name] = getattr(module, alias.name)

    def resolve(self, node):
        """The package object an expression names (sp.ring_attention), or None."""
        if isinstance(node, ast.Name):
            return self.aliases.get(node.id)
        if isinstance(node, ast.Attribute):
            owner = self.resolve(node.value)
            if owner is None or not inspect.ismodule(owner):
                return None
            if not hasattr(owner, node.attr):
                self.problems.append(f"{owner.__name__} has no {node.attr}")
                return None
            return getattr(owner, node.attr)
        return None

    def visit_Call(self, node):
        function = self.resolve(node.func)
        if callable(function) and not any(isinstance(a, ast.Starred) for a in node.args):
            keywords = {k.arg: None for k in node.keywords if k.arg is not None}
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                signature = None
            if signature is not None:
                try:
                    signature.bind_partial(*([None] * len(node.args)), **keywords)
                except TypeError as error:
                    self.problems.append(f"{ast.unparse(node.func)}(...): {error}")
        self.generic_visit(node)

    def visit_Attribute(self, node):
        self.resolve(node)
        self.generic_visit(node)


def _blocks():
    return [
        pytest.param(page, line, source, id=f"{page_id(page)}:{line}")
        for page in PAGES
        for line, source in python_blocks(page)
    ]


@pytest.mark.parametrize("page, line, source", _blocks())
def test_python_blocks_use_the_package_as_it_is(page, line, source):
    if source in EXAMPLES:
        return  # a file of examples/, run as it is by tests/test_readme_example.py
    # "..." stands for arguments a block leaves out: f(a=1, ...) is f(a=1) here.
    tree = ast.parse(re.sub(r",\s*\.\.\.(?=\s*\))", "", source))
    uses = PackageUses()
    for integration in ("transformers", "diffusers"):
        if f"integrations.{integration}" in source:
            pytest.importorskip(integration)
    uses.visit(tree)
    assert uses.aliases, "a block that uses nothing of the package"
    assert not uses.problems, list(dict.fromkeys(uses.problems))
