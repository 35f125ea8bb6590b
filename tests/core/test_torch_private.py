"""One module holds every private torch API the package uses (`core.torch_private`), checked
against the pinned torch: a torch upgrade that moves a name fails here, by name.

Outside it, the package's source may not name a private torch module (`torch._dynamo`), read
an underscore attribute of any object (`op._schema`, `pg._get_backend`: what is not an op name
of `torch.ops` or one of its namespaces, nor `torch._check`, which torch documents), or reach
into a symbolic size's internals (`size.node.expr`, a shape env's replacements or unbacked
symbols). A planted access of each kind is caught."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from dsv41_compile.core import torch_private

PACKAGE = Path(torch_private.__file__).resolve().parents[1]
ALLOWED = {
    PACKAGE / "core" / "torch_private.py": "every private name",
    PACKAGE / "testing" / "torch_shims.py": "torch's own test helpers (never the library's)",
}
DOCUMENTED = {"_check", "_check_is_size", "_check_value"}
"""`torch._check*`: documented in torch's reference despite the underscore."""
NOT_TORCH = {("os", "_exit")}
"""Underscore names of the standard library the package uses."""
SYMBOLIC_INTERNALS = {
    "replacements",
    "deferred_runtime_asserts",
    "var_to_val",
    "backed_var_to_val",
    "create_unbacked_symint",
    "ignore_fresh_unbacked_symbols",
    "create_symintnode",
    "evaluate_expr",
}
"""A shape env's internals (its attributes and methods the package uses)."""
SYMNODE = {"expr", "hint", "shape_env"}
"""A `SymNode`'s, reached as `size.node.<name>`."""


def _private_module(dotted: str) -> bool:
    parts = dotted.split(".")
    return (
        parts[0] == "torch"
        and "ops" not in parts[:2]
        and any(
            p.startswith("_") and not p.startswith("__") and p not in DOCUMENTED for p in parts[1:]
        )
    )


def _chain(node: ast.AST) -> list[str]:
    """`a.b.c` -> ["a", "b", "c"]; a chain over a call or a subscript starts with "?"."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    names.append(node.id if isinstance(node, ast.Name) else "?")
    return list(reversed(names))


def _op_namespaces(tree: ast.Module) -> set[str]:
    """`torch`, and the module-level names bound to `torch.ops` or one of its namespaces
    (`aten = torch.ops.aten`, `aten, c10d = torch.ops.aten, torch.ops._c10d_functional`)."""
    names = {"torch"}
    for node in tree.body:
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = (
                zip(target.elts, node.value.elts)
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple)
                else [(target, node.value)]
            )
            for name, value in pairs:
                if isinstance(name, ast.Name) and _chain(value)[:2] == ["torch", "ops"]:
                    names.add(name.id)
    return names


def private_uses(source: str) -> list[str]:
    tree = ast.parse(source)
    namespaces = _op_namespaces(tree)
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            uses += [
                f"l.{node.lineno}: import {a.name}" for a in node.names if _private_module(a.name)
            ]
        elif isinstance(node, ast.ImportFrom) and _private_module(node.module or ""):
            uses.append(f"l.{node.lineno}: from {node.module}")
        elif isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Store):
            chain, attr = _chain(node), node.attr
            text = f"l.{node.lineno}: {ast.unparse(node)}"
            if attr in SYMBOLIC_INTERNALS or (
                len(chain) > 2 and chain[-2:-1] == ["node"] and attr in SYMNODE
            ):
                uses.append(text)
            elif not attr.startswith("_") or attr.startswith("__"):
                continue
            elif chain[0] in ("self", "cls") and len(chain) == 2:
                continue  # an object's own
            elif chain[0] in namespaces and ("ops" in chain[:2] or chain[0] != "torch"):
                continue  # an op's name: torch.ops._c10d_functional, aten._to_copy
            elif (
                chain[:1] == ["torch"]
                and attr in DOCUMENTED
                and len(chain) == 2
                or tuple(chain) in NOT_TORCH
            ):
                continue
            else:
                uses.append(text)
    return uses


def test_private_torch_is_used_in_one_module():
    found = {
        str(path.relative_to(PACKAGE)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path not in ALLOWED and (uses := private_uses(path.read_text()))
    }
    assert not found, f"private torch API outside core/torch_private.py: {found}"
    assert private_uses((PACKAGE / "core" / "torch_private.py").read_text())  # the scan sees them


@pytest.mark.parametrize(
    "planted",
    [
        "import torch._dynamo",
        "from torch._subclasses.fake_tensor import FakeTensorMode",
        "name = node.target._schema.name",
        "group = dist.group.WORLD._get_backend(device)",
        "version = tensor._version",
        "expr = size.node.expr",
        "hint = val.node.hint",
        "env = size.node.shape_env",
        "pairs = shape_env.replacements",
        "symbol = env.create_unbacked_symint()",
    ],
)
def test_a_planted_private_access_is_caught(planted):
    allowed = "aten = torch.ops.aten\nx = aten._to_copy.default\ntorch._check(True)\n"
    assert private_uses(allowed) == []
    assert private_uses(allowed + planted + "\n") != []


def test_the_pinned_torch_has_every_name():
    assert torch.__version__.split("+")[0] == torch_private.CHECKED_WITH
    for name in torch_private.__all__:
        assert getattr(torch_private, name) is not None, name
    propagator = torch_private.sharding_propagator()
    assert callable(propagator.propagate_op_sharding_non_cached)
    tables = {"op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules"}
    assert tables <= set(dir(propagator))
    assert torch_private.recompile_limit() > 1
    assert torch_private.inductor_cache_dir()
