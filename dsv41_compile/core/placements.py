"""Placements on a mesh axis: DTensor's `Shard` / `Replicate` / `Partial`, plus `ExpertShard`
for expert weights and `ColumnShard` for lookup tables split by their columns, and their short
printed forms (`S(0)`, `R`, `P`, `E(0)`, `C`, `C(host)`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

__all__ = ["ColumnShard", "ExpertShard", "format_placement"]


@dataclass(frozen=True)
class ExpertShard(Placement):
    """Sharded on the expert dim over the ep axis (the whole world, not the tp axis): rank r
    holds experts `[r*E/ep, (r+1)*E/ep)`. Only a routed-experts op consumes such a value; the
    expert_parallel pass turns that op into dispatch -> local experts -> combine."""

    dim: int = 0

    def __repr__(self) -> str:
        return f"E({self.dim})"

    def __reduce__(self) -> tuple:  # Placement is a C++ class: pickle by constructor
        return ExpertShard, (self.dim,)


@dataclass(frozen=True)
class ColumnShard(Placement):
    """A lookup table split by its columns over the ep axis (the whole world): with C columns
    and ep ranks, rank r holds the rows of columns `[r*k, (r+1)*k)`, k = ceil(C/ep), padded to
    the longest such range (`core.signature.ParamShard.ranges`). Only a table-lookup op
    (`core.adapter.TableLookup`) consumes such a table; the `tables` pass turns it into an
    exchange of row ids and rows. `host`: the rank's rows live in host memory, and are looked up
    there."""

    host: bool = False

    def __repr__(self) -> str:
        return "C(host)" if self.host else "C"

    def __reduce__(self) -> tuple:  # Placement is a C++ class: pickle by constructor
        return ColumnShard, (self.host,)


def format_placement(placement: object) -> str:
    """Short form: `S(0)`, `R`, `P` (`P(max)` for a non-sum partial), `-` for no tensor; other
    placements (`E(0)`) by their repr."""
    if placement is None:
        return "-"
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P" if placement.reduce_op == "sum" else f"P({placement.reduce_op})"
    return str(placement)
