"""docs/architecture.md: its tree is the package's, and its worked examples (a model family, an
op rule, a layout, a transition) run as written, in order, in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dsv41_compile
from dsv41_compile import families
from dsv41_compile.spmd import transitions

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
EXAMPLE = re.compile(r"<!-- example: ([^>]+) -->\n```python\n(.*?)```", re.DOTALL)


def test_the_tree_names_every_module_and_folder_of_the_package():
    tree = DOC.read_text().split("```")[1]
    package = Path(dsv41_compile.__file__).parent
    entries = sorted(
        p.name + ("/" if p.is_dir() else "")
        for p in package.iterdir()
        if not p.name.startswith("__pycache__")
    )
    missing = [e for e in entries if e not in tree]
    assert not missing, f"docs/architecture.md's tree does not name {missing}"


@pytest.fixture
def restored_registries():
    with families.REGISTRY.restored(), transitions.TRANSITIONS.restored():
        yield


def test_the_worked_examples_run_as_written(restored_registries):
    examples = EXAMPLE.findall(DOC.read_text())
    assert [name for name, _ in examples] == ["model family", "op rule", "layout", "transition"]
    namespace: dict = {"__name__": "architecture_examples"}
    for name, code in examples:
        exec(compile(code, f"docs/architecture.md ({name})", "exec"), namespace)
