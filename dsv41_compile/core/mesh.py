"""The mesh of one compiled program: world = dp x tp, TP groups of consecutive ranks; the EP
group, when ep > 1, is the whole world.

Rank r is `tp_rank = r % tp` of TP group `dp_rank = r // tp` and holds the routed experts
`[r*E/ep, (r+1)*E/ep)`. The groups are created once per (tp, device) of the default process
group and reused by every recompilation, so that all ranks create the same groups in the same
order whatever their compile history; a new default process group (after
`destroy_process_group`) starts afresh, and the old one's meshes are dropped.

The graph names its groups the same way on every rank. c10d names a TP group by its creation
order, so the two DP groups' TP groups have different names; each rank registers its own TP
group under `tp_group_name(tp)` as well, and the graph uses that name. A per-rank graph is then
the same program on every rank of the host -- what lets one rank compile it for all
(`runtime.host_cache`) and inductor's cache serve the others.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import GroupName

from dsv41_compile.core.torch_private import (
    inherit_timeout,
    register_process_group,
    unregister_process_group,
)

__all__ = ["Mesh", "build_mesh", "tp_group_name"]


@dataclass(frozen=True)
class Mesh:
    world_size: int
    rank: int
    tp: int
    ep: int
    device_type: str
    tp_mesh: DeviceMesh
    """The one-axis mesh of this rank's TP group (`mesh_dim_names == ("tp",)`)."""
    tp_group_name: str
    """The name the graph gives this rank's TP group (the same on every rank)."""
    ep_group_name: str
    """The EP group's (the world's) process-group name."""

    @property
    def dp(self) -> int:
        return self.world_size // self.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.tp

    def axis_rank(self, axis: str) -> int:
        """This rank's index along a mesh axis: `tp_rank` on "tp", the world rank on "ep"."""
        return self.tp_rank if axis == "tp" else self.rank


def tp_group_name(tp: int) -> str:
    return f"dsv41_tp{tp}"


_MESHES: dict[tuple[int, str], DeviceMesh] = {}
"""(tp, device type) -> the TP mesh, for the default process group `_WORLD`."""
_WORLD: list[dist.ProcessGroup | None] = [None]


def build_mesh(*, tp: int, ep: int, device_type: str) -> Mesh:
    """This rank's mesh; raises `ValueError` when no process group exists or `tp` does not
    divide the world."""
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "dsv41_sp needs a process group: call torch.distributed.init_process_group() "
            "(e.g. under torchrun) before the first call of the compiled model"
        )
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % tp:
        raise ValueError(
            f"tp={tp} does not divide the world size {world}: the world is split into "
            f"world/tp data-parallel groups of tp ranks; choose tp in "
            f"{[d for d in range(1, world + 1) if world % d == 0]}"
        )
    if ep not in (1, world):
        raise ValueError(
            f"ep={ep}: the expert-parallel group is the whole world, so ep must be the world "
            f"size {world} (experts sharded over every rank) or 1 (every rank holds every "
            f"routed expert)"
        )
    if _WORLD[0] is not dist.group.WORLD:  # a new default group: the old meshes are gone
        _MESHES.clear()
        _WORLD[0] = dist.group.WORLD
    key = (tp, device_type)
    if key not in _MESHES:
        grid = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        _MESHES[key] = grid["tp"]
        _inherit_timeout(grid["tp"].get_group(), device_type)
        _alias(tp_group_name(tp), grid["tp"].get_group())
    return Mesh(
        world, rank, tp, ep, device_type, _MESHES[key], tp_group_name(tp),
        dist.group.WORLD.group_name,
    )  # fmt: skip


def _inherit_timeout(group: dist.ProcessGroup, device_type: str) -> None:
    """Give the TP group the world's timeout. c10d creates subgroups with its default (30
    minutes for gloo) whatever `init_process_group(timeout=...)` said; a rank waiting on a dead
    TP peer would then hang that long instead of failing at the user's timeout."""
    if group is not dist.group.WORLD:
        inherit_timeout(group, dist.group.WORLD, device_type)


def _alias(name: str, group: dist.ProcessGroup) -> None:
    group_name = GroupName(name)  # (the str itself: c10d's type for a group's name)
    unregister_process_group(group_name)  # from an earlier world; a no-op for an unknown name
    register_process_group(group_name, group)
