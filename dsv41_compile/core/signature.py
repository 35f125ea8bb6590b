"""The per-rank program's signature: what each of its inputs is, the same on every rank.

A per-rank graph takes Dynamo's inputs in Dynamo's order -- the model's parameters and
buffers (some of them as this rank's shard) and the model's inputs (`input_ids`, the cache) --
then `tp_rank`, then, with the padded EP lowering, `ep_tokens`. `localize` writes the signature
(`CompileContext.signature`), `expert_parallel` adds `ep_tokens`; verify, the graph-mode rewrite,
the targets, the runtime and a rank loading another rank's program (`runtime.host_cache`) read it
(`CompileContext.local_inputs`, `ProgramSignature.local_fakes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch.distributed.tensor import Placement

from dsv41_compile.core.torch_private import new_input_size

__all__ = ["ParamInput", "ParamShard", "ProgramSignature"]


@dataclass(frozen=True)
class ParamShard:
    """A parameter the graph receives as a local shard: chunk `mesh.axis_rank(axis)` of `parts`
    on `dim` (a tp shard by `tp_rank`, an expert shard by the world rank) -- equal chunks, or
    with `ranges` the given `[start, stop)` of each part, padded to the longest (a table split
    by its columns)."""

    fqn: str
    placement: Placement
    dim: int
    parts: int
    axis: str
    ranges: tuple[tuple[int, int], ...] | None = None
    dtype: torch.dtype | None = None
    """The dtype the program holds the shard in, its bytes reinterpreted (a table's FP8 codes and
    e8m0 scales as uint8: what its exchange moves); None: the parameter's own."""

    @property
    def host(self) -> bool:
        """The shard lives in host memory (a table placed `ColumnShard(host=True)`)."""
        return bool(getattr(self.placement, "host", False))

    def local_shape(self, shape: Sequence[int]) -> list[int]:
        shape = list(shape)
        if self.ranges is None:
            shape[self.dim] //= self.parts
        else:
            shape[self.dim] = max(stop - start for start, stop in self.ranges)
        return shape

    def bounds(self, part: int, size: int) -> tuple[int, int]:
        """Part `part`'s `[start, stop)` of a dim of `size`."""
        if self.ranges is not None:
            return self.ranges[part]
        step = size // self.parts
        return part * step, (part + 1) * step

    def take(self, full: torch.Tensor, part: int) -> torch.Tensor:
        """Part `part` of `full`, contiguous, zero-padded to the local length."""
        start, stop = self.bounds(part, full.shape[self.dim])
        return self.padded(full.narrow(self.dim, start, stop - start))

    def padded(self, part: torch.Tensor) -> torch.Tensor:
        """A part (its own rows only) as the program holds it: zero-padded to the local length
        (the longest range), in `dtype`."""
        if self.dtype is not None:
            part = part.view(self.dtype)
        if self.ranges is not None:
            short = max(stop - start for start, stop in self.ranges) - part.shape[self.dim]
            if short:
                pad = list(part.shape)
                pad[self.dim] = short
                part = torch.cat([part, torch.zeros(pad, dtype=part.dtype)], self.dim)
        return part.contiguous()


@dataclass(frozen=True)
class ParamInput:
    """A parameter or buffer input of the program: its position, FQN, global shape and dtype,
    and the shard of it the program takes (None: all of it)."""

    index: int
    fqn: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    buffer: bool = False
    shard: ParamShard | None = None
    prepare: str | None = None
    """A preparation the runtime applies once to the tensor it takes (its shard, or the whole
    parameter), by name (`runtime.program.PREPARATIONS`): a layout a kernel reads the weight in
    (torch_npu's NZ for the grouped matmul's FP4 weights) -- the same values and shape, made at
    load instead of on every call."""


@dataclass(frozen=True)
class ProgramSignature:
    params: tuple[ParamInput, ...]
    """The model's parameters and buffers among the inputs."""
    inputs: tuple[tuple[int, str], ...]
    """(position, name) of the model's other inputs (`input_ids`, `cache.window_kv[0]`)."""
    token_inputs: tuple[str, ...]
    """The inputs whose dim 0 is the token count (the adapter's); the first one's length is T."""
    ep_tokens: bool = False
    """The program takes `ep_tokens` (padded EP dispatch) after `tp_rank`."""

    @property
    def n_model_inputs(self) -> int:
        """Dynamo's inputs: the ones before `tp_rank`."""
        return len(self.params) + len(self.inputs)

    def index_of(self, name: str) -> int:
        return next(i for i, n in self.inputs if n == name)

    @cached_property
    def token_index(self) -> int:
        """The position of the first token input."""
        return self.index_of(self.token_inputs[0])

    @cached_property
    def token_positions(self) -> tuple[tuple[int, str], ...]:
        """(position, name) of every token input."""
        return tuple((self.index_of(name), name) for name in self.token_inputs)

    @cached_property
    def param_indices(self) -> frozenset[int]:
        """The positions of the model's weights (parameters and buffers, sharded or not)."""
        return frozenset(p.index for p in self.params)

    @cached_property
    def param_shards(self) -> dict[int, ParamShard]:
        """Position -> shard, for the parameters the program takes as local shards."""
        return {p.index: p.shard for p in self.params if p.shard is not None}

    @cached_property
    def weights(self) -> tuple[ParamInput, ...]:
        """The parameters (not buffers): what a checkpoint holds."""
        return tuple(p for p in self.params if not p.buffer)

    def with_ep_tokens(self) -> ProgramSignature:
        return dataclasses.replace(self, ep_tokens=True)

    @cached_property
    def prepared(self) -> dict[int, str]:
        """Position -> preparation, for the parameters the runtime prepares once."""
        return {p.index: p.prepare for p in self.params if p.prepare is not None}

    def with_preparation(self, index: int, prepare: str) -> ProgramSignature:
        """The signature with the parameter at position `index` prepared by `prepare`."""
        params = tuple(
            dataclasses.replace(p, prepare=prepare) if p.index == index else p for p in self.params
        )
        return dataclasses.replace(self, params=params)

    def with_shard(self, index: int, shard: ParamShard) -> ProgramSignature:
        """The signature with the parameter at position `index` taken as `shard`."""
        params = tuple(
            dataclasses.replace(p, shard=shard) if p.index == index else p for p in self.params
        )
        return dataclasses.replace(self, params=params)

    def local_fakes(
        self, model_fakes: Sequence[Any], fake_mode: Any, *, loaded: bool, ep_tokens: Any = None
    ) -> list[Any]:
        """Fake values of the program's inputs from fake values of Dynamo's (`model_fakes`,
        global shapes): each sharded parameter at its local shape, then `tp_rank`, then
        `ep_tokens` (a fresh size symbol unless given). A sharded parameter -- with `loaded`
        (the `checkpoint` option: the rank's own tensors) every parameter -- is contiguous, as
        the runtime passes it."""
        fakes = list(model_fakes[: self.n_model_inputs])
        for p in self.params:
            if p.shard is None and (p.buffer or not loaded):
                continue
            shape = list(p.shape) if p.shard is None else p.shard.local_shape(p.shape)
            dtype = p.dtype if p.shard is None or p.shard.dtype is None else p.shard.dtype
            device = torch.device("cpu") if p.shard and p.shard.host else fakes[p.index].device
            with fake_mode:
                fakes[p.index] = torch.empty(shape, dtype=dtype, device=device)
        with fake_mode:
            fakes.append(torch.zeros((), dtype=torch.int64))
        if self.ep_tokens:
            if ep_tokens is None:
                ep_tokens = new_input_size(fake_mode.shape_env)
            fakes.append(ep_tokens)
        return fakes
