"""The mesh of one compiled program: world = dp x tp, TP groups of consecutive ranks; the EP
group, when ep > 1, is the whole world.

Rank r is `tp_rank = r % tp` of TP group `dp_rank = r // tp` (DESIGN §2) and holds the routed
experts `[r*E/ep, (r+1)*E/ep)`. The groups are
created once per (world, tp) and reused by every recompilation, so that all ranks create the same
groups in the same order whatever their compile history.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["Mesh", "build_mesh", "clear_mesh_cache"]


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
    """The TP group's process-group name, as the functional collectives take it."""
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


_MESHES: dict[tuple[int, int, int, str], DeviceMesh] = {}


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
    key = (id(dist.group.WORLD), world, tp, device_type)
    if key not in _MESHES:
        grid = init_device_mesh(device_type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
        _MESHES[key] = grid["tp"]
    tp_mesh = _MESHES[key]
    return Mesh(
        world,
        rank,
        tp,
        ep,
        device_type,
        tp_mesh,
        tp_mesh.get_group().group_name,
        dist.group.WORLD.group_name,
    )


def clear_mesh_cache() -> None:
    """Forget the cached meshes (after `destroy_process_group`, e.g. between tests)."""
    _MESHES.clear()
