"""The per-rank program as AOTAutograd calls it, once per call of the compiled model.

`ProgramSpec` is what a program is besides its compiled graph -- its inputs (which are
parameter shards, where the token count is: `core.signature.ProgramSignature`), its EP layers,
what its dumps show -- and is the same on every rank (the host compile cache stores it,
`runtime.host_cache`). `ShardedProgram` binds it to this rank.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from dsv41_compile.core.mesh import Mesh
from dsv41_compile.core.registry import Registry
from dsv41_compile.core.signature import ProgramSignature
from dsv41_compile.core.torch_private import version_counter
from dsv41_compile.moe.stats import EpLayer
from dsv41_compile.runtime.checks import check_same_inputs, collective_failure

__all__ = ["PREPARATIONS", "ProgramSpec", "ShardedProgram"]

PREPARATIONS: Registry[Callable[[torch.Tensor], torch.Tensor]] = Registry("weight preparation")
"""Preparations of a weight the runtime applies once (`core.signature.ParamInput.prepare`), by
name: a function of the tensor the program takes (its shard) to the tensor it reads -- the same
values and shape (a kernel's layout). The targets register theirs."""


@dataclass(frozen=True)
class ProgramSpec:
    """A per-rank program besides its graph, the same on every rank."""

    signature: ProgramSignature
    """Its inputs."""
    ep_layers: tuple[EpLayer, ...] = ()
    """One per MoE layer lowered over the EP group: the graph's trailing statistics outputs."""
    text: str | None = None
    """The graph as `graph.py` shows it (`report.dump.graph_text`); None unless the options ask
    for a dump (`dump_dir`: printing flash's graph takes seconds)."""
    comm: tuple[dict[str, Any], ...] = ()
    """One record per collective (`report.comm.comm_records`)."""


class ShardedProgram:
    """The compiled per-rank graph as AOT calls it: full parameters in, local shards to the
    graph. Each sharded parameter is sliced once and reused until it is replaced or modified in
    place (its version counter moves); with `weights` (the `checkpoint` option) the rank's own
    tensors replace the parameters instead. Appends the inputs the rewrite added: `tp_rank`, and for
    padded EP dispatch `ep_tokens` (the largest token-shard length over the EP group, agreed
    with one all-reduce(max) of an integer, outside the graph). The graph's trailing
    EP-statistics outputs are kept in `ep_stats`, not returned; `on_ep_stats`, when set,
    receives them with the call's `ep_tokens` (or Tl). `check_batch`, when set, checks each
    call's inputs first (the model's own messages for a batch it refuses), on every rank
    before any collective."""

    _boxed_call = True

    def __init__(
        self,
        compiled: Callable[..., Any],
        spec: ProgramSpec,
        *,
        tp: int,
        tp_rank: int,
        rank: int,
        device_type: str = "cpu",
        on_ep_stats: Callable[[list[torch.Tensor], int], None] | None = None,
        check_inputs: dist.ProcessGroup | None = None,
        weights: dict[int, torch.Tensor] | None = None,
        check_batch: Callable[[Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.compiled, self.spec, self.signature = compiled, spec, spec.signature
        self.tp, self.tp_rank, self.rank, self.device_type = tp, tp_rank, rank, device_type
        self.on_ep_stats = on_ep_stats
        self.check_inputs = check_inputs
        """The TP group, when the `check_inputs` option asks for the check before each call."""
        self.weights = weights
        """Input index -> this rank's tensor of that parameter, read from the `checkpoint`
        option's directory (`runtime.weights`): the model's own parameters are not used."""
        self.check_batch = check_batch
        """The family's check of a call's inputs (`ModelAdapter.check_inputs`: the model's own
        messages), before anything of the call runs."""
        self._named = {name: i for i, name in self.signature.inputs}
        """Input name -> position, for the family's check (a view of each call's arguments)."""
        self._taken = sorted({*self.signature.param_shards, *self.signature.prepared})
        """The parameters taken by `local_shard`: sharded, or prepared."""
        self._prepared = set(self.signature.prepared)
        self.calls = 0
        self.tp_rank_tensor: torch.Tensor | None = None  # made at the first call, not under
        # the compile-time fake mode
        self._shards: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.ep_stats: list[torch.Tensor] = []
        self.ep_tokens = 0  # of the last call

    @staticmethod
    def for_mesh(
        compiled: Callable[..., Any],
        spec: ProgramSpec,
        mesh: Mesh,
        *,
        check_inputs: bool = False,
        **kw: Any,
    ) -> ShardedProgram:
        return ShardedProgram(
            compiled, spec, tp=mesh.tp, tp_rank=mesh.tp_rank, rank=mesh.rank,
            device_type=mesh.device_type,
            check_inputs=mesh.tp_mesh.get_group() if check_inputs else None, **kw,
        )  # fmt: skip

    def local_shard(self, index: int, full: torch.Tensor, *, take: bool = True) -> torch.Tensor:
        """The tensor the program takes for parameter `index`: its shard (or all of it; with
        `take=False` `full` is the rank's own already, read from a checkpoint), as its
        preparation leaves it (`PREPARATIONS`), made once and kept until the parameter is
        replaced or modified in place."""
        cached = self._shards.get(index)
        if cached is not None and cached[0] is full and cached[1] == version_counter(full):
            return cached[2]
        local = full
        shard = self.signature.param_shards.get(index) if take else None
        if shard is not None:
            local = shard.take(full, self.tp_rank if shard.axis == "tp" else self.rank)
            if shard.host:
                local = local.cpu()  # a table in host memory: looked up on the host
        prepare = self.signature.prepared.get(index)
        if prepare is not None:
            local = _prepared(prepare, local)
        self._shards[index] = (full, version_counter(full), local)
        return local

    def agree_ep_tokens(self, tokens: int) -> int:
        """The largest ceil(T/tp) over the EP group (the world)."""
        local = torch.tensor([-(-tokens // self.tp)], dtype=torch.int64, device=self.device_type)
        dist.all_reduce(local, op=dist.ReduceOp.MAX)
        return int(local.item())

    def __call__(self, args: list[Any]) -> Any:
        self.calls += 1
        try:
            return self._call(list(args))
        except RuntimeError as error:
            failure = collective_failure(error, self.rank, self.calls)
            if failure is None:
                raise
            raise failure from error

    def _call(self, args: list[Any]) -> Any:
        if self.check_batch is not None:
            self.check_batch(_Named(args, self._named))
        if self.check_inputs is not None:
            indices, names = zip(*self.signature.token_positions)
            check_same_inputs(
                [args[i] for i in indices], names, self.check_inputs, self.rank // self.tp
            )
        tokens = args[self.signature.token_index].shape[0]
        if self.weights is not None:
            for index, weight in self.weights.items():
                prepared = index in self._prepared
                args[index] = self.local_shard(index, weight, take=False) if prepared else weight
        else:
            for index in self._taken:
                args[index] = self.local_shard(index, args[index])
        if self.tp_rank_tensor is None:
            self.tp_rank_tensor = torch.tensor(self.tp_rank, dtype=torch.int64)
        args.append(self.tp_rank_tensor)
        own = agreed = -(-tokens // self.tp)
        if self.signature.ep_tokens:
            agreed = self.agree_ep_tokens(tokens)
            args.append(agreed)
        # The EP lowering's rows per rank: the agreed Tl_max when padded, else the rank's own Tl
        # (an exact EP lowering beside a column-split table's exchange still sends its own rows).
        layers = self.spec.ep_layers
        self.ep_tokens = agreed if layers and layers[0].dispatch == "padded" else own
        outputs = self.compiled(*args)
        n_stats = len(layers)
        if not n_stats:
            return outputs
        self.ep_stats = list(outputs[-n_stats:])
        if self.on_ep_stats is not None:
            self.on_ep_stats(self.ep_stats, self.ep_tokens)
        return type(outputs)(outputs[:-n_stats])


class _Named(Mapping[str, Any]):
    """A call's arguments by input name, read where they are: the check before each call
    reads a few of them, not a copy of every input (a model's cache is hundreds)."""

    def __init__(self, args: list[Any], positions: dict[str, int]) -> None:
        self._args, self._positions = args, positions

    def __getitem__(self, name: str) -> Any:
        return self._args[self._positions[name]]

    def __iter__(self) -> Iterator[str]:
        return iter(self._positions)

    def __len__(self) -> int:
        return len(self._positions)


def _prepared(name: str, tensor: torch.Tensor) -> torch.Tensor:
    prepare = PREPARATIONS.get(name)
    if prepare is None:
        raise ValueError(
            f"this program reads a weight prepared by {name!r}, which no target registered: "
            "import the target that compiled it (its lowering's module registers it)"
        )
    return prepare(tensor)
