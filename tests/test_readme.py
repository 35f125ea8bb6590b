"""The options are documented once, in two tables of docs/reference.md (the generic options,
DeepSeek V4.1's own): each table names exactly its class's fields, in order, and lists each
default first."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from dsv41_compile.deepseek_v41.options import DeepseekV41Options
from dsv41_compile.options import BackendOptions

REFERENCE = Path(__file__).resolve().parents[1] / "docs" / "reference.md"


def _tables() -> list[list[tuple[str, str]]]:
    """The option tables, each as (option, its first listed value) per row."""
    section = REFERENCE.read_text().split("## Options", 1)[1].split("\n## ", 1)[0]
    tables: list[list[tuple[str, str]]] = []
    rows: list[tuple[str, str]] | None = None
    for line in section.splitlines():
        if line.startswith("| option |"):
            rows = []
            tables.append(rows)
        elif rows is not None and line.startswith("| `"):
            name, values = (cell.strip() for cell in line.split("|")[1:3])
            rows.append((name.strip("`"), re.match(r"`([^`]*)`", values).group(1)))
        elif not line.startswith("|"):
            rows = None
    return tables


@pytest.mark.parametrize(("index", "cls"), [(0, BackendOptions), (1, DeepseekV41Options)])
def test_an_options_table_is_its_class(index, cls):
    rows = _tables()[index]
    fields = [f for f in dataclasses.fields(cls) if f.name != "family"]
    assert [name for name, _ in rows] == [f.name for f in fields]
    for (name, first), field in zip(rows, fields):
        default = field.default_factory() if field.default is dataclasses.MISSING else field.default
        assert ast.literal_eval(first) == default, name
