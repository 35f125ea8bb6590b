"""The two kinds of compile error.

A user mistake (an option, the mesh, an input, a graph break, an op without a rule) is a
`ValueError` or `NotImplementedError` whose message says what to change; the passes raise those
directly. A broken invariant of our own passes is an `InternalError`: the pass manager adds the
pass that broke it and writes the graph it left behind, so the report carries what a fix
needs. `InternalError` derives from the package's own base, `Dsv41Error`, not from
`AssertionError`: code that handles a library's failed assertion (DTensor's rules assert)
never swallows one of ours.
"""

from __future__ import annotations

from torch.fx import Node

from dsv41_compile.core.meta import describe

__all__ = ["Dsv41Error", "InternalError", "as_node"]


class Dsv41Error(Exception):
    """The base of the errors dsv41_compile defines."""


class InternalError(Dsv41Error):
    """An invariant of dsv41_compile's own passes does not hold: a bug in dsv41_compile, not in
    the model. `node` is where it was found; the pass manager fills in `pass_name` and
    `graph_path`."""

    def __init__(self, message: str, node: Node | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.node = node
        self.pass_name: str | None = None
        self.graph_path: str | None = None

    def __str__(self) -> str:
        where = f" in pass {self.pass_name!r}" if self.pass_name else ""
        at = f" at {describe(self.node)}" if self.node is not None else ""
        text = f"dsv41_sp internal error{where}{at}: {self.message}."
        text += " This is a bug in dsv41_compile, not in your model"
        if self.graph_path:
            text += f"; the graph the pass left is in {self.graph_path} (attach it to the report)"
        return text


def as_node(arg: object, what: str) -> Node:
    """`arg`, an argument a pass knows to hold a tensor, as the node it is (FX types an argument
    as any value); `what` names the argument in the `InternalError` raised when it is not one."""
    if not isinstance(arg, Node):
        raise InternalError(f"expected a node as {what}, got {arg!r}")
    return arg
