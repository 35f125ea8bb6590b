"""quantised_transport: a TP collective that moves what an activation quantisation makes, or
only feeds one, moves the quantised rows instead (codes and their scales, in bytes).

Requires: localize (a per-rank graph with its collectives). Ensures: each collective below
moves `encode(v)` (uint8 rows) instead of bf16 `v`, and its receiver decodes them; the values
every op computes are unchanged, bit for bit; every node has its local value (`meta["val"]`:
the collective's and its wait's are now the bytes).

The model adapter names its quantisation (`core.adapter.ActivationRows`): an op `quantize`
that rounds each row's blocks of `block` values along the last dim on their own, an `encode`
to bytes and a `decode` with `decode(encode(x)) == quantize(x)`. Moving rows, and reshaping
without splitting a block, commute with it. Two forms qualify, found from the graph:

- **the value moved is the quantisation's output** (`v = quantize(x)`; the attention entry
  gathering what the FP8 GEMMs take): the collective moves `encode(x)`, and `decode` gives
  `quantize(x)`, which is `v`;
- **every use of the value moved is a quantisation**, through ops that only move rows or
  regroup whole blocks (the attention exit's all-to-all of `wo_b`'s input, which `wo_b`
  quantises): the collective moves `encode(v)`, the receiver decodes and regroups, and each
  quantisation's output is its input (already `quantize` of the moved rows).

The collective keeps its node and its reason, which now also says what it moves; the bytes
follow from the graph (`report.accounting`). The EP dispatch moves its quantised rows by the
same adapter entry (`moe.expert_parallel`).
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import cast

import torch
from torch.fx import GraphModule, Node

from dsv41_compile.core.adapter import ActivationRows
from dsv41_compile.core.context import CompileContext
from dsv41_compile.core.fake_prop import propagate_local_values, propagate_nodes
from dsv41_compile.core.meta import GLOBAL_VAL, OUT, REASON, REGION

__all__ = ["quantised_transport"]

c10d = torch.ops._c10d_functional
aten = torch.ops.aten

_COLLECTIVES = (c10d.all_gather_into_tensor.default, c10d.all_to_all_single.default)


def quantised_transport(gm: GraphModule, *, ctx: CompileContext) -> None:
    codec = ctx.adapter.activation_rows
    if codec is None or not any(n.target == codec.quantize for n in gm.graph.nodes):
        return
    propagate_local_values(gm, ctx)  # the local shapes of the collectives' neighbours
    for node in list(gm.graph.nodes):
        if node.target not in _COLLECTIVES or not node.meta.get(REASON):
            continue
        (wait,) = node.users
        value = node.args[0]
        if value.target == codec.quantize:
            _move_encoded(gm, node, wait, value.args[0], ctx, "its quantisation's input")
        elif (quantizations := _only_quantized(wait, codec)) is not None:
            _move_encoded(gm, node, wait, value, ctx, "the rows its receiver quantises")
            for q in quantizations:  # the decoded rows are quantize(rows) already
                q.replace_all_uses_with(cast(Node, q.args[0]))
                gm.graph.erase_node(q)
    gm.graph.lint()
    gm.recompile()


def _move_encoded(
    gm: GraphModule, collective: Node, wait: Node, source: Node, ctx: CompileContext, what: str
) -> None:
    """The collective moves `codec.encode(source)` and its receivers read the decoded rows;
    the nodes made and changed get their local values (the collective's are now bytes)."""
    codec = cast(ActivationRows, ctx.adapter.activation_rows)
    graph = gm.graph
    width = source.meta["val"].shape[-1]
    with graph.inserting_before(collective):
        encoded = graph.call_function(codec.encode, (source,))
    collective.replace_input_with(cast(Node, collective.args[0]), encoded)
    with graph.inserting_after(wait):
        decoded = graph.call_function(codec.decode, (wait,))
    wait.replace_all_uses_with(decoded, delete_user_cb=lambda user: user is not decoded)
    encoded_width = codec.width(width)
    why = {
        encoded: f"{codec.name} rows for {collective.name} (quantised_transport)",
        decoded: f"{codec.name} rows from {collective.name} (quantised_transport)",
    }
    for new in (encoded, decoded):
        new.meta[REASON] = why[new]  # inserted around the collective, as its pads and waits
        new.meta[REGION] = collective.meta.get(REGION, "")
        new.meta[OUT] = None
        for key in ("stack_trace", "nn_module_stack"):
            if key in collective.meta:
                new.meta[key] = collective.meta[key]
    for moved in (collective, wait):
        moved.meta.pop(GLOBAL_VAL, None)  # now bytes
    propagate_nodes([encoded, collective, wait, decoded], ctx)
    collective.meta[REASON] += (
        f"; moves {codec.name} rows of {what} ({encoded_width} B per row against "
        f"{2 * width} B in bf16: quantised_transport)"
    )


def _only_quantized(wait: Node, codec: ActivationRows) -> list[Node] | None:
    """The quantisations every use of `wait`'s value reaches, through ops that move rows or
    regroup whole blocks; None if a use reaches anything else."""
    found: list[Node] = []
    pending = [wait]
    while pending:
        node = pending.pop()
        for user in node.users:
            if user.target == codec.quantize:
                found.append(user)
            elif _moves_rows(user, codec.block):
                pending.append(user)
            else:
                return None
    return found or None


def _moves_rows(node: Node, block: int) -> bool:
    """Whether `node` moves whole rows of its input, or regroups them in whole blocks of the
    last dim (what a row-wise blockwise quantisation commutes with)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return True
    ndim = _input_ndim(node)
    if ndim is None:
        return False
    last = ndim - 1
    target = node.target
    if target in (aten.split_with_sizes.default, aten.split.Tensor):
        return _dim(node, 2, 0, ndim) != last
    if target in (aten.slice.Tensor, aten.narrow.default, aten.index_select.default):
        return _dim(node, 1, 0, ndim) != last
    if target is aten.unflatten.int:
        return _dim(node, 1, 0, ndim) != last
    if target is aten.permute.default:
        return list(cast(Sequence[int], node.args[1]))[-1] % ndim == last
    if target in (aten.clone.default, aten.contiguous.default):
        return True
    if target in (aten.view.default, aten._unsafe_view.default, aten.reshape.default):
        value = node.args[0].meta.get("val")
        if not isinstance(value, torch.Tensor):
            return False
        old, new = value.shape[-1], node.meta["val"].shape[-1]
        # the last dim kept, or whole rows of blocks merged into it
        return (
            isinstance(old, int)
            and isinstance(new, int)
            and (new == old or (old % block == 0 and new % old == 0))
        )
    return False


def _input_ndim(node: Node) -> int | None:
    value = node.args[0].meta.get("val") if isinstance(node.args[0], Node) else None
    return value.dim() if isinstance(value, torch.Tensor) else None


def _dim(node: Node, position: int, default: int, ndim: int) -> int:
    dim = node.args[position] if len(node.args) > position else node.kwargs.get("dim", default)
    return cast(int, dim) % ndim
