"""The `checkpoint` option: each rank's weights, read from the checkpoint when its first
program is built.

A rank reads only what its program takes: its slice of every sharded parameter (a tp shard's
rows or columns, an EP rank's experts) and all of every replicated one, decoded to the
parameter's dtype (the model family's `ModelAdapter.read_weights`). The program then runs on
these tensors and ignores the model's own parameters, which may have no memory behind them
(`storage.has_no_weights`). The tensors are shared by every program compiled from the same
checkpoint (a recompile reads nothing) and live as long as one of those programs does.
"""

from __future__ import annotations

import os
import weakref
from typing import cast

import torch

from dsv41_compile.core.adapter import ModelAdapter, WeightInput, WeightRange, WeightSlice
from dsv41_compile.core.mesh import Mesh
from dsv41_compile.core.signature import ParamShard, ProgramSignature
from dsv41_compile.core.torch_private import unset_fake_temporarily

__all__ = ["READ", "rank_weights", "weight_inputs"]

_LOADED: weakref.WeakValueDictionary[tuple[str, WeightInput], torch.Tensor] = (
    weakref.WeakValueDictionary()
)
"""(checkpoint, weight) -> the tensor a program of this process holds."""
READ: dict[str, int] = {}
"""Bytes this process read per checkpoint tensor (scales included)."""


def weight_inputs(signature: ProgramSignature, mesh: Mesh) -> dict[int, WeightInput]:
    """Input index -> what this rank holds of that parameter (buffers are not read)."""
    out = {}
    for p in signature.weights:
        part: WeightSlice | WeightRange | None = None
        if p.shard is not None and p.shard.ranges is not None:
            start, stop = p.shard.ranges[mesh.axis_rank(p.shard.axis)]
            part = WeightRange(p.shard.dim, start, stop)
        elif p.shard is not None:
            part = WeightSlice(p.shard.dim, mesh.axis_rank(p.shard.axis), p.shard.parts)
        out[p.index] = WeightInput(p.fqn, p.shape, p.dtype, part)
    return out


def rank_weights(
    adapter: ModelAdapter,
    path: str,
    signature: ProgramSignature,
    mesh: Mesh,
    *,
    skip_unimplemented_parts: bool,
) -> dict[int, torch.Tensor]:
    """Input index -> this rank's tensor of that parameter (`weight_inputs`; a range shorter
    than the shard's longest zero-padded to it), read from `path` unless this process already
    did; on the mesh's device, or in host memory for a host-resident table."""
    wanted = weight_inputs(signature, mesh)
    shards = signature.param_shards
    loaded = _read(adapter, path, wanted, mesh.device_type, skip_unimplemented_parts, shards)
    return loaded


def _read(
    adapter: ModelAdapter,
    path: str,
    wanted: dict[int, WeightInput],
    device_type: str,
    skip_unimplemented_parts: bool,
    shards: dict[int, ParamShard],
) -> dict[int, torch.Tensor]:
    root = os.path.realpath(path)
    held = {w: _LOADED.get((root, w)) for w in wanted.values()}
    if any(t is None for t in held.values()):
        weights = list(wanted.values())
        with unset_fake_temporarily():  # built during a compile, under its fake mode
            tensors, read = adapter.read_weights(
                root, weights, skip_unimplemented_parts=skip_unimplemented_parts
            )
        for name, n in read.items():
            READ[name] = READ.get(name, 0) + n
        for index, w in wanted.items():
            if held[w] is not None:
                continue
            tensor, shard = tensors[weights.index(w)], shards.get(index)
            with unset_fake_temporarily():
                if shard is not None and shard.ranges is not None:
                    tensor = shard.padded(tensor)
                host = shard.host if shard is not None else False
                held[w] = _LOADED[root, w] = tensor if host else tensor.to(device_type)
    # every weight is held now (read above where it was not)
    return {index: cast(torch.Tensor, held[w]) for index, w in wanted.items()}
