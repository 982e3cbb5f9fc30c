"""Every Python block of the README and of docs/ runs, on 4 gloo CPU ranks: what a
block leaves to the reader (its model, dataset, batch, pipeline) made small by
tests/doc_standins.py, what it writes at a size no test machine has scaled down there
(listed; each rewrite must apply somewhere). The blocks that are files of examples/
run as they are under torchrun (tests/test_readme_example.py); tests/test_docs.py
checks every block's names and signatures statically, without running it."""

from __future__ import annotations

import ast
import builtins
import os
import tempfile

import pytest

pytest.importorskip("transformers")

from conftest import pool_for  # noqa: E402
from doc_standins import SCALE_DOWNS, scaled_down  # noqa: E402
from on_ranks import on_every_rank  # noqa: E402
from test_docs import EXAMPLES, PAGES, page_id, python_blocks  # noqa: E402

WORLD_SIZE = 4


class _FreeNames(ast.NodeVisitor):
    """Walks a block in the order it runs (an assignment's value before its targets)."""

    def __init__(self):
        self.defined, self.free = set(dir(builtins)), set()

    def visit_Name(self, node):
        if isinstance(node.ctx, ast.Load):
            if node.id not in self.defined:
                self.free.add(node.id)
        else:
            self.defined.add(node.id)

    def visit_Assign(self, node):
        self.visit(node.value)
        for target in node.targets:
            self.visit(target)

    def visit_arg(self, node):
        self.defined.add(node.arg)

    def visit_Lambda(self, node):
        self.visit(node.args)
        self.visit(node.body)

    def visit_FunctionDef(self, node):
        self.defined.add(node.name)
        self.generic_visit(node)

    visit_ClassDef = visit_FunctionDef

    def visit_Import(self, node):
        self.defined.update((alias.asname or alias.name).split(".")[0] for alias in node.names)

    visit_ImportFrom = visit_Import


def free_names(source: str) -> set[str]:
    """The names a block uses before it defines them (if ever)."""
    visitor = _FreeNames()
    visitor.visit(ast.parse(source))
    return visitor.free


def _runnable_blocks():
    blocks = []
    for page in PAGES:
        for line, source in python_blocks(page):
            if source not in EXAMPLES:
                blocks.append(pytest.param(source, id=f"{page_id(page)}:{line}"))
    return blocks


RUNNABLE = _runnable_blocks()


@on_every_rank
def run_block(source: str) -> None:
    from doc_standins import standins

    runnable, _ = scaled_down(source)
    namespace = standins(free_names(runnable), runnable)
    here = os.getcwd()
    try:
        os.chdir(tempfile.mkdtemp())  # a block's output_dir="out"
        exec(compile(runnable, "<block>", "exec"), namespace)
    finally:
        os.chdir(here)


@pytest.mark.parametrize("source", RUNNABLE)
def test_every_block_runs(source):
    for integration in ("diffusers", "trl", "peft"):
        if f"import {integration}" in source or f"from {integration}" in source or f"{integration}s." in source:
            pytest.importorskip(integration)
    pool_for(WORLD_SIZE).run(run_block, source)


def test_every_scale_down_applies_to_some_block():
    applied = set().union(*(scaled_down(block.values[0])[1] for block in RUNNABLE))
    unused = [pattern for index, (pattern, _) in enumerate(SCALE_DOWNS) if index not in applied]
    assert not unused, unused
